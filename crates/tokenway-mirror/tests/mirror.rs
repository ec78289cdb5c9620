//! Publish to a `file://` origin and pull back: identity, resume, corruption, traversal.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use tokenway_mirror::manifest::{blob_key, manifest_key};
use tokenway_mirror::{
    open_origin, publish, pull, pull_from, Blake3Hash, FileEntry, Manifest, ModelRef,
    PublishOptions, PullOptions,
};

const PIECE: u64 = 1 << 20;

/// Writes a safetensors-like file: 8-byte little-endian header length, JSON header, data.
fn safetensors(path: &Path, data_len: usize, rng: &mut SmallRng) {
    let header = format!(
        "{{\"weight\":{{\"dtype\":\"F16\",\"shape\":[{}],\"data_offsets\":[0,{data_len}]}}}}",
        data_len / 2
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    let start = bytes.len();
    bytes.resize(start + data_len, 0);
    rng.fill_bytes(&mut bytes[start..]);
    std::fs::write(path, bytes).unwrap();
}

/// A ~21 MB model of five files (one empty, one nested, two sharded weights).
fn make_model(dir: &Path) {
    let mut rng = SmallRng::seed_from_u64(7);
    std::fs::create_dir_all(dir.join("tokenizer")).unwrap();
    safetensors(
        &dir.join("model-00001-of-00002.safetensors"),
        12 << 20,
        &mut rng,
    );
    safetensors(
        &dir.join("model-00002-of-00002.safetensors"),
        (9 << 20) + 12345,
        &mut rng,
    );
    std::fs::write(dir.join("config.json"), br#"{"hidden_size":64}"#).unwrap();
    std::fs::write(dir.join("tokenizer/tokenizer.json"), b"{\"vocab\":{}}").unwrap();
    std::fs::write(dir.join("empty.txt"), b"").unwrap();
}

struct Setup {
    _tmp: tempfile::TempDir,
    src: PathBuf,
    origin_dir: PathBuf,
    out: PathBuf,
    origin: Arc<dyn object_store::ObjectStore>,
    manifest: Manifest,
}

async fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let origin_dir = tmp.path().join("origin");
    let out = tmp.path().join("out");
    make_model(&src);
    let origin = open_origin(&format!("file://{}", origin_dir.display())).unwrap();
    let opts = PublishOptions {
        piece_size: PIECE,
        parallel: 2,
        ..Default::default()
    };
    let report = publish(
        Arc::clone(&origin),
        &src,
        "org/tiny",
        "r1",
        Some("latest"),
        &opts,
    )
    .await
    .unwrap();
    assert_eq!(report.files, 5);
    // Both small JSON files differ, the empty file is a blob too: 5 distinct blobs.
    assert_eq!(report.blobs_uploaded, 5);
    Setup {
        manifest: report.manifest.unwrap(),
        _tmp: tmp,
        src,
        origin_dir,
        out,
        origin,
    }
}

fn assert_identical(src: &Path, out: &Path, manifest: &Manifest) {
    for f in &manifest.files {
        let a = std::fs::read(src.join(&f.path)).unwrap();
        let b = std::fs::read(out.join(&f.path)).unwrap();
        assert!(a == b, "{} differs", f.path);
    }
}

fn total_pieces(m: &Manifest) -> u64 {
    m.files.iter().map(|f| f.pieces.len() as u64).sum()
}

#[tokio::test]
async fn publish_then_pull_is_byte_identical_and_repeats_are_free() {
    let s = setup().await;
    let mref = ModelRef::parse("org/tiny").unwrap();
    let r = pull(
        Arc::clone(&s.origin),
        &mref,
        &s.out,
        &PullOptions::default(),
    )
    .await
    .unwrap();
    assert!(r.complete);
    assert_eq!(r.files_written, 5);
    assert_eq!(r.pieces_written, total_pieces(&s.manifest));
    assert_eq!(r.bytes_fetched, s.manifest.total_size());
    assert_eq!(r.pieces_corrupt, 0);
    assert_identical(&s.src, &s.out, &s.manifest);
    assert!(!s.out.join(".partial").exists(), "partial dir cleaned up");

    // Republishing the same revision uploads nothing; pulling again fetches nothing.
    let again = publish(
        Arc::clone(&s.origin),
        &s.src,
        "org/tiny",
        "r1",
        None,
        &PublishOptions {
            piece_size: PIECE,
            parallel: 2,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!((again.blobs_uploaded, again.blobs_skipped), (0, 5));
    // What a run that exited while finishing a blob leaves behind is cleared by the next.
    let stale = s.out.join(".partial");
    std::fs::create_dir_all(&stale).unwrap();
    let hex = s.manifest.files[0].hash.to_hex();
    std::fs::write(stale.join(format!("{hex}.progress")), b"{}").unwrap();
    std::fs::write(stale.join(format!("{hex}.progress.tmp")), b"").unwrap();
    let r2 = pull(
        Arc::clone(&s.origin),
        &ModelRef::parse("org/tiny@r1").unwrap(),
        &s.out,
        &PullOptions::default(),
    )
    .await
    .unwrap();
    assert!(r2.complete);
    assert_eq!((r2.files_already_present, r2.pieces_fetched), (5, 0));
    assert!(
        !stale.exists(),
        "stale records removed with the partial dir"
    );
}

#[tokio::test]
async fn a_published_revision_is_not_replaced_by_other_files() {
    let s = setup().await;
    let opts = PublishOptions {
        piece_size: PIECE,
        parallel: 2,
        ..Default::default()
    };
    let other = s._tmp.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("config.json"), br#"{"hidden_size":128}"#).unwrap();
    let err = publish(Arc::clone(&s.origin), &other, "org/tiny", "r1", None, &opts)
        .await
        .unwrap_err();
    assert!(
        matches!(err, tokenway_mirror::MirrorError::RevisionExists { .. }),
        "{err}"
    );
    let key = s.origin_dir.join(manifest_key("org/tiny", "r1"));
    let kept = Manifest::from_json(&std::fs::read(&key).unwrap()).unwrap();
    assert!(kept.same_content(&s.manifest), "r1 is unchanged");
}

#[tokio::test]
async fn interrupted_pull_resumes_refetching_at_most_the_pieces_in_flight() {
    let s = setup().await;
    let mref = ModelRef::parse("org/tiny:latest").unwrap();
    let total = total_pieces(&s.manifest);
    let parallel = 4;
    let opts = PullOptions {
        parallel,
        piece_budget: Some(total / 2),
        ..PullOptions::default()
    };
    let first = pull(Arc::clone(&s.origin), &mref, &s.out, &opts)
        .await
        .unwrap();
    assert!(!first.complete);
    assert!(first.pieces_written >= total / 2 && first.pieces_written < total);
    assert!(first.pieces_discarded_in_flight <= parallel as u64);
    // Whatever is under a final name is complete and verified; something is still missing.
    let mut missing = 0;
    for f in &s.manifest.files {
        match std::fs::read(s.out.join(&f.path)) {
            Ok(b) => assert_eq!(Blake3Hash::of(&b), f.hash, "{} placed unverified", f.path),
            Err(_) => missing += 1,
        }
    }
    assert!(missing > 0);

    let second = pull(
        Arc::clone(&s.origin),
        &mref,
        &s.out,
        // Same cancel flag: the budget stop of the first run must not leak into this one.
        &PullOptions {
            piece_budget: None,
            ..opts.clone()
        },
    )
    .await
    .unwrap();
    assert!(second.complete);
    assert_identical(&s.src, &s.out, &s.manifest);
    assert_eq!(first.pieces_written + second.pieces_written, total);
    assert!(
        second.pieces_resumed > 0,
        "the resume reused recorded pieces"
    );
    let refetched = first.bytes_fetched + second.bytes_fetched - s.manifest.total_size();
    assert!(
        refetched <= first.pieces_discarded_in_flight * PIECE,
        "re-downloaded {refetched} bytes, more than the {} pieces in flight",
        first.pieces_discarded_in_flight
    );
}

/// A port nothing listens on (connections are refused).
fn refused_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A fake peer: answers every request with 503.
async fn failing_peer() -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = c.read(&mut buf).await;
                let _ = c
                    .write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
            });
        }
    });
    port
}

#[tokio::test]
async fn dead_and_fake_peers_claiming_every_piece_do_not_use_up_the_attempts_of_the_origin() {
    use tokenway_mirror::mirror::peers::PeerView;
    use tokenway_mirror::piece_bits::PieceBits;
    let s = setup().await;
    let sources = Arc::new(tokenway_mirror::SourceSet::origin_only(Arc::clone(
        &s.origin,
    )));
    let have: std::collections::HashMap<_, _> = s
        .manifest
        .files
        .iter()
        .map(|f| (f.hash, PieceBits::full(f.pieces.len() as u64).to_wire()))
        .collect();
    let mut ports: Vec<u16> = (0..4).map(|_| refused_port()).collect();
    let dead = ports.clone();
    for _ in 0..4 {
        ports.push(failing_peer().await);
    }
    sources.set_peers(
        ports
            .iter()
            .map(|p| PeerView {
                id: format!("p{p}"),
                addr: format!("127.0.0.1:{p}"),
                have: have.clone(),
                taking: Default::default(),
            })
            .collect(),
    );
    let parallel = 4;
    let opts = PullOptions {
        parallel,
        max_attempts: 1,
        ..PullOptions::default()
    };
    let r = pull_from(Arc::clone(&sources), s.manifest.clone(), &s.out, &opts)
        .await
        .unwrap();
    assert!(r.complete);
    assert_identical(&s.src, &s.out, &s.manifest);
    assert_eq!(r.bytes_from_peers, 0);
    assert_eq!(r.bytes_from_origin, s.manifest.total_size());
    assert!(r.source_errors > 0, "the peers were tried");
    // A peer that refuses connections is demoted at its first failure: it fails at most
    // once per piece that was already on its way to it.
    for p in dead {
        let name = format!("peer http://127.0.0.1:{p}");
        let failures = r
            .sources_failing
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, k)| *k);
        assert!(
            failures as usize <= parallel,
            "{name} failed {failures} times: {:?}",
            r.sources_failing
        );
    }
}

/// A resume record whose padding bits (past the last piece) are set, beside a partial file
/// holding only its first pieces: the pull fetches the rest and completes, instead of taking
/// the blob for finished, failing its whole-file check and deleting the verified progress.
#[tokio::test]
async fn a_resume_record_with_bits_past_the_last_piece_still_completes_the_pull() {
    let s = setup().await;
    let f = s
        .manifest
        .files
        .iter()
        .find(|f| f.pieces.len() % 8 != 0 && f.pieces.len() > 8)
        .expect("a file whose piece count is not a multiple of 8")
        .clone();
    let n = f.pieces.len();
    let partial_dir = s.out.join(".partial");
    std::fs::create_dir_all(&partial_dir).unwrap();
    let mut bytes = std::fs::read(s.src.join(&f.path)).unwrap();
    bytes[6 * PIECE as usize..].fill(0);
    std::fs::write(partial_dir.join(f.hash.to_hex()), &bytes).unwrap();
    // Pieces 0..6 done, and every bit past piece n-1 set.
    let mut done = vec![0u8; n.div_ceil(8)];
    done[0] = 0x3f;
    *done.last_mut().unwrap() |= !((1u8 << (n % 8)) - 1);
    let record = format!(
        r#"{{"hash":"{}","piece_size":{},"pieces":{n},"done":"{}"}}"#,
        f.hash,
        f.piece_size,
        done.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    std::fs::write(
        partial_dir.join(format!("{}.progress", f.hash.to_hex())),
        record,
    )
    .unwrap();
    let mref = ModelRef::parse("org/tiny").unwrap();
    let r = pull(
        Arc::clone(&s.origin),
        &mref,
        &s.out,
        &PullOptions::default(),
    )
    .await
    .unwrap();
    assert!(r.complete);
    assert_eq!(r.pieces_resumed, 6);
    assert_identical(&s.src, &s.out, &s.manifest);
}

/// Two paths with the same bytes: the second gets a synced copy, renamed into place.
/// A model of `a.bin` and its copy `sub/a-copy.bin` (3 MiB of random bytes from `seed`), plus
/// `extra` files, published as `model` (tag latest) to a file origin under `tmp`: the origin,
/// the bytes of `a.bin`, and an output directory.
async fn publish_with_a_copy(
    tmp: &Path,
    seed: u64,
    extra: &[(&str, &[u8])],
    model: &str,
) -> (
    Arc<dyn object_store::ObjectStore>,
    Vec<u8>,
    std::path::PathBuf,
) {
    let src = tmp.join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    let mut data = vec![0u8; 3 << 20];
    SmallRng::seed_from_u64(seed).fill_bytes(&mut data);
    std::fs::write(src.join("a.bin"), &data).unwrap();
    std::fs::write(src.join("sub/a-copy.bin"), &data).unwrap();
    for (name, bytes) in extra {
        std::fs::write(src.join(name), bytes).unwrap();
    }
    let origin = open_origin(&format!("file://{}", tmp.join("origin").display())).unwrap();
    publish(
        Arc::clone(&origin),
        &src,
        model,
        "r1",
        Some("latest"),
        &PublishOptions::default(),
    )
    .await
    .unwrap();
    (origin, data, tmp.join("out"))
}

#[tokio::test]
async fn duplicate_paths_are_each_placed_with_the_same_verified_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let (origin, data, out) = publish_with_a_copy(tmp.path(), 3, &[], "org/dup").await;
    let mref = ModelRef::parse("org/dup").unwrap();
    let r = pull(origin, &mref, &out, &PullOptions::default())
        .await
        .unwrap();
    assert!(r.complete);
    assert_eq!(r.files_written, 2);
    assert!(std::fs::read(out.join("a.bin")).unwrap() == data);
    assert!(std::fs::read(out.join("sub/a-copy.bin")).unwrap() == data);
    assert!(!out.join(".partial").exists());
}

#[tokio::test]
async fn a_rerun_trusts_the_files_it_verified_until_they_change_and_progress_reaches_the_end() {
    use std::sync::Mutex;
    let tmp = tempfile::tempdir().unwrap();
    let config: &[u8] = br#"{"hidden_size":64}"#;
    let (origin, data, out) =
        publish_with_a_copy(tmp.path(), 4, &[("config.json", config)], "org/v").await;
    let mref = ModelRef::parse("org/v").unwrap();
    let last = Arc::new(Mutex::new(None));
    let seen = Arc::clone(&last);
    let opts = PullOptions {
        progress: Some(Arc::new(move |p: &tokenway_mirror::PullProgress| {
            *seen.lock().unwrap() = Some(p.clone());
        })),
        ..PullOptions::default()
    };
    let r = pull(Arc::clone(&origin), &mref, &out, &opts).await.unwrap();
    assert!(r.complete);
    // A file listed twice is counted twice in the total and so in what is done (it used to
    // stop short of the total by the copy's size).
    let p = last.lock().unwrap().clone().expect("progress reported");
    assert_eq!(p.bytes_done, p.bytes_total, "{p:?}");
    assert_eq!(p.files_done, 3);
    assert!(!p.checking);
    assert!(out.join(".tokenway/verified.json").exists());

    // A rerun reads nothing: every file is listed and unchanged.
    let again = pull(Arc::clone(&origin), &mref, &out, &opts).await.unwrap();
    assert_eq!(
        (
            again.files_already_present,
            again.files_hashed,
            again.pieces_fetched
        ),
        (3, 0, 0)
    );
    // `--verify` hashes them all, and they are fine.
    let verify = PullOptions {
        verify: true,
        ..opts.clone()
    };
    let checked = pull(Arc::clone(&origin), &mref, &out, &verify)
        .await
        .unwrap();
    assert_eq!(
        (
            checked.files_already_present,
            checked.files_hashed,
            checked.pieces_fetched
        ),
        (3, 3, 0)
    );
    // One byte changed in place, same size: the change is seen, the file hashed, found
    // wrong and fetched again (with its copy, which shares its content); the rest trusted.
    let mut bytes = std::fs::read(out.join("a.bin")).unwrap();
    bytes[1000] ^= 1;
    std::thread::sleep(std::time::Duration::from_millis(50));
    std::fs::write(out.join("a.bin"), &bytes).unwrap();
    let fixed = pull(Arc::clone(&origin), &mref, &out, &opts).await.unwrap();
    assert!(fixed.complete);
    assert_eq!(fixed.files_already_present, 1, "config.json");
    assert_eq!(fixed.files_hashed, 0);
    assert_eq!(fixed.files_written, 2);
    assert_eq!(std::fs::read(out.join("a.bin")).unwrap(), data);
    assert_eq!(std::fs::read(out.join("sub/a-copy.bin")).unwrap(), data);
    // A stopped pull stops while checking, fetching nothing and keeping what it listed.
    let stopped = PullOptions {
        verify: true,
        cancel: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        ..opts.clone()
    };
    let r = pull(Arc::clone(&origin), &mref, &out, &stopped)
        .await
        .unwrap();
    assert!(!r.complete);
    assert_eq!(r.pieces_fetched, 0);
    let again = pull(Arc::clone(&origin), &mref, &out, &opts).await.unwrap();
    assert_eq!((again.files_already_present, again.files_hashed), (3, 0));
}

/// A second pull into a directory another live pull is using is refused with a clear error
/// (instead of tripping over its renames); a lock left by a pull that is gone is taken over.
#[tokio::test]
async fn a_pull_into_a_directory_another_pull_is_using_is_refused_and_a_stale_lock_taken_over() {
    let s = setup().await;
    // Another pull holds the directory (another open of the lock file holds it as another
    // process would).
    let held = tokenway_mirror::dir_lock::DirLock::take(&s.out).unwrap();
    let mref = ModelRef::parse("org/tiny").unwrap();
    let err = pull(
        Arc::clone(&s.origin),
        &mref,
        &s.out,
        &PullOptions::default(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        err.contains(&format!("another pull (pid {} on ", std::process::id())),
        "{err}"
    );
    assert!(!s.out.join(".partial").exists(), "nothing written");
    // The holder is gone (its process ended, which drops the lock): a pull completes, and a
    // lock file naming a dead pid (the pid lock of earlier versions) does not stand in its way.
    drop(held);
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let gone_pid = gone.id();
    gone.wait().unwrap();
    std::fs::write(s.out.join(".tokenway/lock"), format!("pid {gone_pid}")).unwrap();
    let r = pull(
        Arc::clone(&s.origin),
        &mref,
        &s.out,
        &PullOptions::default(),
    )
    .await
    .unwrap();
    assert!(r.complete);
    assert_identical(&s.src, &s.out, &s.manifest);
    assert!(!s.out.join(".partial").exists());
    // A caller that keeps the lock (to serve the files) lends it to the pull.
    let kept = Arc::new(tokenway_mirror::dir_lock::DirLock::take(&s.out).unwrap());
    let r = pull(
        Arc::clone(&s.origin),
        &mref,
        &s.out,
        &PullOptions {
            dir_lock: Some(Arc::clone(&kept)),
            ..PullOptions::default()
        },
    )
    .await
    .unwrap();
    assert!(r.complete);
    assert!(
        tokenway_mirror::dir_lock::DirLock::take(&s.out).is_err(),
        "still held by the caller after the pull"
    );
}

#[tokio::test]
async fn corrupt_piece_in_origin_fails_naming_file_and_piece_and_is_not_placed() {
    let s = setup().await;
    let victim: &FileEntry = s
        .manifest
        .files
        .iter()
        .find(|f| f.path == "model-00001-of-00002.safetensors")
        .unwrap();
    let blob = s.origin_dir.join(blob_key(&victim.hash));
    let mut bytes = std::fs::read(&blob).unwrap();
    bytes[(2 * PIECE + 10) as usize] ^= 0x01;
    std::fs::write(&blob, bytes).unwrap();

    let err = pull(
        Arc::clone(&s.origin),
        &ModelRef::parse("org/tiny").unwrap(),
        &s.out,
        &PullOptions {
            max_attempts: 2,
            ..PullOptions::default()
        },
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("model-00001-of-00002.safetensors"), "{err}");
    assert!(err.contains("piece 2"), "{err}");
    assert!(err.contains("2 times"), "{err}");
    assert!(err.contains("--reupload"), "{err}");
    assert!(!s.out.join(&victim.path).exists(), "corrupt file placed");
    // The other files are unaffected and in place.
    assert_eq!(
        std::fs::read(s.out.join("config.json")).unwrap(),
        std::fs::read(s.src.join("config.json")).unwrap()
    );

    // A plain publish skips the bad object (right name, right size); --reupload repairs it.
    let opts = |reupload| PublishOptions {
        piece_size: PIECE,
        reupload,
        ..Default::default()
    };
    let (plain, forced) = (opts(false), opts(true));
    let publish_again = |o| {
        publish(
            Arc::clone(&s.origin),
            &s.src,
            "org/tiny",
            "r1",
            Some("latest"),
            o,
        )
    };
    assert_eq!(publish_again(&plain).await.unwrap().blobs_uploaded, 0);
    assert_eq!(publish_again(&forced).await.unwrap().blobs_uploaded, 5);
    let r = pull(
        Arc::clone(&s.origin),
        &ModelRef::parse("org/tiny").unwrap(),
        &s.out,
        &PullOptions::default(),
    )
    .await
    .unwrap();
    assert!(r.complete);
    assert_identical(&s.src, &s.out, &s.manifest);
}

#[tokio::test]
async fn manifest_with_path_traversal_is_rejected_before_writing_anything() {
    let tmp = tempfile::tempdir().unwrap();
    let origin_dir = tmp.path().join("origin");
    let origin = open_origin(&format!("file://{}", origin_dir.display())).unwrap();
    let evil = serde_json::json!({
        "format": 1,
        "model": "m",
        "revision": "r",
        "files": [{
            "path": "../escaped",
            "size": 1,
            "hash": Blake3Hash::of(b"x").to_hex(),
            "piece_size": PIECE,
            "pieces": [Blake3Hash::of(b"x").to_hex()],
        }],
    });
    let key = origin_dir.join(manifest_key("m", "r"));
    std::fs::create_dir_all(key.parent().unwrap()).unwrap();
    std::fs::write(&key, serde_json::to_vec(&evil).unwrap()).unwrap();

    let out = tmp.path().join("out");
    let err = pull(
        origin,
        &ModelRef::parse("m@r").unwrap(),
        &out,
        &PullOptions::default(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("files[0].path"), "{err}");
    assert!(err.contains("traversal"), "{err}");
    assert!(!tmp.path().join("escaped").exists());
    assert!(!out.exists());
}

#[tokio::test]
async fn unknown_tag_and_bad_names_give_clear_errors() {
    let s = setup().await;
    let err = pull(
        Arc::clone(&s.origin),
        &ModelRef::parse("org/tiny:stable").unwrap(),
        &s.out,
        &PullOptions::default(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("tag stable of model org/tiny not found"),
        "{err}"
    );
    let err = publish(
        Arc::clone(&s.origin),
        &s.src,
        "org/../x",
        "r2",
        None,
        &PublishOptions::default(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("invalid model"), "{err}");
}

/// A pull into a 4 MiB filesystem of a 21 MB model is refused before it fetches anything,
/// with the numbers; the same pull into a roomy directory works. Needs root (mount).
#[tokio::test]
async fn a_pull_that_cannot_fit_on_the_disk_is_refused_before_fetching() {
    let s = setup().await;
    let small = tempfile::tempdir().unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(small.path())
        .status()
        .is_ok_and(|st| st.success());
    if !mounted {
        eprintln!("skipped: mounting a small tmpfs needs root (CI runs as root)");
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(small.path().to_path_buf());
    let mref = ModelRef::parse("org/tiny").unwrap();
    let opts = PullOptions::default();
    let e = pull(
        Arc::clone(&s.origin),
        &mref,
        &small.path().join("out"),
        &opts,
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("more on the disk") && e.contains("GB"), "{e}");
    let r = pull(Arc::clone(&s.origin), &mref, &s.out, &opts)
        .await
        .unwrap();
    assert!(r.complete);
}

/// A mirror that answers its RTT probes and every other request with `manifest`.
async fn lying_mirror(manifest: Vec<u8>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            let body = manifest.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let n = c.read(&mut buf).await.unwrap_or(0);
                let body = if buf[..n].starts_with(b"GET /healthz") {
                    b"ok\n".to_vec()
                } else {
                    body
                };
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = c.write_all(head.as_bytes()).await;
                let _ = c.write_all(&body).await;
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn with_an_origin_given_the_manifest_comes_from_it_not_from_a_mirror() {
    let s = setup().await;
    // The mirror (or someone on the path to a plain-HTTP mirror) hands out a manifest whose
    // file hashes are its own: the pull would verify its bytes against them.
    let mut forged = s.manifest.clone();
    forged.files[0].hash = Blake3Hash::of(b"someone else's weights");
    let mirror = lying_mirror(forged.to_json()).await;
    let sources = tokenway_mirror::SourceSet::new(
        &[mirror],
        Some(Arc::clone(&s.origin)),
        1,
        None,
        None,
        &tokenway_mirror::tls::ClientTrust::default(),
    )
    .await
    .unwrap();
    let mref = ModelRef::parse("org/tiny@r1").unwrap();
    let m = sources.resolve(&mref).await.unwrap();
    assert_eq!(m.files[0].hash, s.manifest.files[0].hash);
    assert_ne!(m.files[0].hash, forged.files[0].hash);
}
