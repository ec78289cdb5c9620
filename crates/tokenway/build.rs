//! Links the gateway's per-request functions side by side, in the order of
//! `hot-symbols.txt` (written by `scripts/hot-symbols.sh` from a profile of the gateway).
//!
//! A request that finds the CPU's caches cold, as one does between others' work, pays for every
//! page and line of code it touches; scattered over the binary the request path spans ~190
//! pages, listed together ~80, and a single stream's added latency through the gateway falls by
//! ~6 us (docs/benchmarks.md, "Hot code on few pages"). Names the linker does not find (code
//! changed since the list was made) are skipped without a warning.
//!
//! The code segment starts on a 2 MiB boundary (`-z separate-code`, `-z max-page-size`), so
//! that `src/huge_text.rs` can move those functions onto one huge page at run time.
//!
//! Only where the linker is LLD, as it is by default for `x86_64-unknown-linux-gnu` since Rust
//! 1.90; elsewhere the binary links in the linker's own order.

fn main() {
    let order = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("hot-symbols.txt");
    println!("cargo:rerun-if-changed={}", order.display());
    println!("cargo:rerun-if-env-changed=TOKENWAY_NO_SYMBOL_ORDER");
    println!("cargo:rerun-if-env-changed=CARGO_ENCODED_RUSTFLAGS");
    // Flags that choose another linker (`-C linker=...`, `-C linker-features=-lld`) may mean
    // one without `--symbol-ordering-file`.
    let own_linker = std::env::var("CARGO_ENCODED_RUSTFLAGS").is_ok_and(|f| f.contains("linker"));
    let lld_by_default = std::env::var("TARGET").as_deref() == Ok("x86_64-unknown-linux-gnu")
        && rustc_minor().is_some_and(|minor| minor >= 90)
        && !own_linker;
    if lld_by_default && order.exists() && std::env::var_os("TOKENWAY_NO_SYMBOL_ORDER").is_none() {
        println!(
            "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={},--no-warn-symbol-ordering,-z,separate-code,-z,max-page-size=0x200000",
            order.display()
        );
    }
}

/// The minor version of the compiler building this crate (`1.MINOR.patch`).
fn rustc_minor() -> Option<u32> {
    let rustc = std::env::var_os("RUSTC")?;
    let out = std::process::Command::new(rustc).arg("-vV").output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let release = text.lines().find_map(|l| l.strip_prefix("release: "))?;
    release.split('.').nth(1)?.parse().ok()
}
