//! What the `s3://` and `az://` origin tests share: the model they publish, the publish and
//! pull steps, the listing check and the "fails with this message" check, each run through a
//! `tokenway` process that sees only the provider's variables the test gives it.

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::s3::{free_port, stderr, write_model};

/// A storage server (moto, Azurite) on a loopback port, killed on drop.
pub struct LocalServer {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `command(port)` on a free loopback port and waits until it accepts; retries with
/// another port when the server exits first (it lost the port to someone else).
pub fn start_local_server(what: &str, command: impl Fn(u16) -> Command) -> LocalServer {
    for _ in 0..3 {
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let child = command(addr.port())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{what} starts: {e}"));
        let mut server = LocalServer { child, addr };
        let end = Instant::now() + Duration::from_secs(30);
        while Instant::now() < end {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return server;
            }
            if server.child.try_wait().ok().flatten().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = server.child.kill();
    }
    panic!("{what} did not start on loopback");
}

/// Runs `tokenway ARGS` with `env`, and none of the caller's variables that start with one of
/// `scoped` (`AWS_`, `AZURE_`...).
pub fn tokenway(args: &[&str], env: &[(&str, &str)], scoped: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokenway"));
    cmd.args(args).env("RUST_LOG", "warn").stdin(Stdio::null());
    for (k, _) in std::env::vars() {
        if scoped.iter().any(|p| k.starts_with(p)) {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("tokenway binary runs")
}

/// A way to run `tokenway ARGS` with some environment.
pub type Run<'a> = &'a dyn Fn(&[&str], &[(&str, &str)]) -> Output;

/// Writes the test model into `work/src`, publishes it to `origin` as `org/tiny@r1` (tag
/// latest, 256 KiB pieces), checks the report, then publishes again and checks nothing was
/// uploaded. Returns the files (relative path, bytes).
pub fn publish_twice(
    run: Run,
    env: &[(&str, &str)],
    work: &Path,
    origin: &str,
) -> Vec<(String, Vec<u8>)> {
    let src = work.join("src");
    let files = write_model(&src);
    let src_arg = src.display().to_string();
    let args = [
        "publish",
        &src_arg,
        "--origin",
        origin,
        "--model",
        "org/tiny",
        "--revision",
        "r1",
        "--tag",
        "latest",
        "--piece-size-kib",
        "256",
    ];
    let out = run(&args, env);
    assert!(out.status.success(), "publish failed: {}", stderr(&out));
    assert!(
        stderr(&out).contains("4 blobs uploaded"),
        "publish report: {}",
        stderr(&out)
    );
    let out = run(&args, env);
    assert!(out.status.success(), "republish failed: {}", stderr(&out));
    assert!(
        stderr(&out).contains("0 blobs uploaded") && stderr(&out).contains("0 outboards uploaded"),
        "{}",
        stderr(&out)
    );
    files
}

/// Checks a listing of the bucket or container: everything under `models/v1/`, the four
/// blobs, one outboard each (64 KiB groups) and the tag.
pub fn assert_published_listing(names: &[&str]) {
    assert!(
        names.iter().all(|k| k.starts_with("models/v1/")),
        "{names:?}"
    );
    let count = |p: &str, end: &str| {
        names
            .iter()
            .filter(|k| k.starts_with(p) && k.ends_with(end))
            .count()
    };
    assert_eq!(count("models/v1/blobs/", ""), 4, "{names:?}");
    assert_eq!(count("models/v1/outboards/", "-65536"), 4, "{names:?}");
    assert!(
        names.contains(&"models/v1/models/org/tiny/tags/latest"),
        "{names:?}"
    );
}

/// Pulls `org/tiny` from `origin` into `dest` and compares with `files`.
pub fn pull_and_compare(
    run: Run,
    env: &[(&str, &str)],
    origin: &str,
    dest: &Path,
    files: &[(String, Vec<u8>)],
) {
    let dest_arg = dest.display().to_string();
    let out = run(
        &["pull", "org/tiny", "--origin", origin, "--out", &dest_arg],
        env,
    );
    assert!(out.status.success(), "pull failed: {}", stderr(&out));
    for (rel, want) in files {
        let got = std::fs::read(dest.join(rel)).expect("pulled file exists");
        assert!(got == *want, "{rel}: pulled bytes differ from published");
    }
}

/// A pull from `origin` (into `out_dir`) must fail within 30 s, saying `want`.
pub fn assert_pull_fails(run: Run, env: &[(&str, &str)], origin: &str, out_dir: &Path, want: &str) {
    let out_arg = out_dir.display().to_string();
    let t = Instant::now();
    let out = run(
        &["pull", "org/tiny", "--origin", origin, "--out", &out_arg],
        env,
    );
    let err = stderr(&out);
    eprintln!("expected failure for {origin}: {}", err.trim());
    assert!(!out.status.success(), "pull from {origin} should fail");
    assert!(err.contains(want), "want {want:?} in: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "failing took {:?}",
        t.elapsed()
    );
}
