//! The gateway moves the start of its code (its request path, linked first) onto a huge page
//! at start-up, and serves from the copy (src/huge_text.rs).

use crate::harness::*;

/// `(start, end, perms, path)` of every mapping in `/proc/<pid>/maps`.
fn maps(pid: u32) -> Vec<(u64, u64, String, String)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("read maps");
    text.lines()
        .map(|l| {
            let mut f = l.split_whitespace();
            let range = f.next().expect("range");
            let perms = f.next().expect("perms").to_owned();
            let path = f.nth(3).unwrap_or("").to_owned();
            let (a, b) = range.split_once('-').expect("a-b");
            let hex = |s| u64::from_str_radix(s, 16).expect("hex");
            (hex(a), hex(b), perms, path)
        })
        .collect()
}

#[tokio::test]
async fn the_gateway_serves_from_its_code_moved_onto_a_huge_page() {
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if !(thp.contains("[always]") || thp.contains("[madvise]")) {
        eprintln!("skipped: transparent huge pages are disabled here ({thp:?})");
        return;
    }
    if std::env::var("TOKENWAY_HUGE_TEXT").as_deref() == Ok("off") {
        eprintln!("skipped: TOKENWAY_HUGE_TEXT=off");
        return;
    }
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "", "");
    let reply = post(
        &format!("{}/v1/chat/completions", gw.url()),
        &chat("hello", true, 4),
        None,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.contains("data: [DONE]"), "{}", reply.body);

    let binary = std::fs::canonicalize(env!("CARGO_BIN_EXE_tokenway")).expect("binary path");
    let binary = binary.to_string_lossy();
    let m = maps(gw.child.id());
    // The copy: 2 MiB of anonymous, read-only executable memory, aligned to 2 MiB, right
    // before the rest of the binary's code, still mapped from the file.
    let moved = m.windows(2).find(|w| {
        let (copy, rest) = (&w[0], &w[1]);
        copy.2 == "r-xp"
            && copy.3.is_empty()
            && copy.1 - copy.0 == 2 << 20
            && copy.0 % (2 << 20) == 0
            && rest.0 == copy.1
            && rest.2 == "r-xp"
            && rest.3 == binary
    });
    assert!(
        moved.is_some(),
        "no 2 MiB anonymous code mapping before {binary}'s code: {m:#?}"
    );
}
