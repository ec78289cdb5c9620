//! The `az://` origin against a real Azure Blob Storage API: Azurite (installed by
//! scripts/setup.sh from npm) on an ephemeral loopback port with an account and key of the
//! test's own, the container created and listed with the official `azure-storage-blob` Python
//! SDK. Real `tokenway publish` / `tokenway pull` processes, configured only through the
//! `AZURE_*` environment variables.

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::harness::{command_has, python_has, TempDir};
use crate::s3::{free_port, python, stderr, write_model};

const ACCOUNT: &str = "weightsacct";
const CONTAINER: &str = "weights";

/// Azurite's blob service, killed on drop.
struct Azurite {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Azurite {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Azurite {
    /// The account's blob endpoint (Azurite puts the account in the path).
    fn endpoint(&self) -> String {
        format!("http://{}/{ACCOUNT}", self.addr)
    }
}

/// Starts `azurite-blob` (in memory) on a free loopback port with one account, `key`.
fn start_azurite(key: &str) -> Azurite {
    for _ in 0..3 {
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let child = Command::new("azurite-blob")
            .args(["--blobHost", "127.0.0.1", "--blobPort"])
            .arg(addr.port().to_string())
            .args(["--inMemoryPersistence", "--silent", "--skipApiVersionCheck"])
            .env("AZURITE_ACCOUNTS", format!("{ACCOUNT}:{key}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("azurite-blob starts");
        let mut azurite = Azurite { child, addr };
        let end = Instant::now() + Duration::from_secs(30);
        while Instant::now() < end {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return azurite;
            }
            if azurite.child.try_wait().ok().flatten().is_some() {
                break; // lost the port race; try another
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = azurite.child.kill();
    }
    panic!("azurite did not start on loopback");
}

/// Creates a container (argv: endpoint, account, key, container).
const CREATE_PY: &str = r#"
import sys
from azure.storage.blob import BlobServiceClient
ep, account, key, container = sys.argv[1:5]
BlobServiceClient(ep, credential={"account_name": account, "account_key": key}) \
    .create_container(container)
"#;

/// Lists the blob names of a container (argv: endpoint, account, key, container).
const LIST_PY: &str = r#"
import sys
from azure.storage.blob import BlobServiceClient
ep, account, key, container = sys.argv[1:5]
svc = BlobServiceClient(ep, credential={"account_name": account, "account_key": key})
for b in svc.get_container_client(container).list_blobs():
    print(b.name)
"#;

/// Runs `tokenway ARGS` with only the given `AZURE_*` variables (none inherited).
fn tokenway(args: &[&str], azure: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokenway"));
    cmd.args(args).env("RUST_LOG", "warn").stdin(Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("AZURE_") || k.starts_with("AZURITE_") || k == "MSI_ENDPOINT" {
            cmd.env_remove(k);
        }
    }
    cmd.envs(azure.iter().copied());
    cmd.output().expect("tokenway binary runs")
}

/// The account's key (64 random bytes, base64, as Azure's are) and another one.
const KEY: &str =
    "oxwGvUY+OSO8Gq295IsWl2wIBxc3O4GaBo8yt6azi2s4cpZHz94Bws4osmxXRyc39cNWGhdhGFvYWJpDzgu6dQ==";
const WRONG_KEY: &str =
    "UvImZaYMEtKJGF2VDuiBNgkWb2sRPReNbA/TkB/yOaGglfIPk5VlDPk4C47bIkprJIoekk6P0K4uGpSSozBfGA==";

#[test]
fn azure_origin_publish_then_pull_is_byte_identical_and_bad_access_fails_clearly() {
    if !python_has("azure.storage.blob") || !command_has("azurite-blob") {
        return;
    }
    let started = Instant::now();
    let key = KEY.to_string();
    let azurite = start_azurite(&key);
    let endpoint = azurite.endpoint();
    python(CREATE_PY, &[&endpoint, ACCOUNT, &key, CONTAINER]);
    let good = [
        ("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT),
        ("AZURE_STORAGE_ACCOUNT_KEY", key.as_str()),
        ("AZURE_STORAGE_ENDPOINT", endpoint.as_str()),
        ("AZURE_ALLOW_HTTP", "true"),
    ];

    let work = TempDir::new("azure");
    let src = work.0.join("src");
    let files = write_model(&src);
    let origin = format!("az://{CONTAINER}/models/v1");
    let src_arg = src.display().to_string();
    let publish_args = [
        "publish",
        &src_arg,
        "--origin",
        &origin,
        "--model",
        "org/tiny",
        "--revision",
        "r1",
        "--tag",
        "latest",
        "--piece-size-kib",
        "256",
    ];
    let out = tokenway(&publish_args, &good);
    assert!(out.status.success(), "publish failed: {}", stderr(&out));
    assert!(
        stderr(&out).contains("4 blobs uploaded"),
        "publish report: {}",
        stderr(&out)
    );

    // Everything landed under the prefix, content addressed, as the Azure SDK sees it.
    let listed = python(LIST_PY, &[&endpoint, ACCOUNT, &key, CONTAINER]);
    let names: Vec<&str> = listed.lines().collect();
    assert!(
        names.iter().all(|k| k.starts_with("models/v1/")),
        "{names:?}"
    );
    let under = |p: &str| names.iter().filter(|k| k.starts_with(p)).count();
    assert_eq!(under("models/v1/blobs/"), 4, "{names:?}");
    assert_eq!(under("models/v1/outboards/"), 4, "{names:?}");
    assert!(
        names.contains(&"models/v1/models/org/tiny/tags/latest"),
        "{names:?}"
    );

    // Publishing the same revision again uploads nothing.
    let out = tokenway(&publish_args, &good);
    assert!(out.status.success(), "republish failed: {}", stderr(&out));
    assert!(
        stderr(&out).contains("0 blobs uploaded") && stderr(&out).contains("0 outboards uploaded"),
        "{}",
        stderr(&out)
    );

    // Pulled back twice: with the account's endpoint, and in Azurite mode
    // (AZURE_STORAGE_USE_EMULATOR with AZURITE_BLOB_STORAGE_URL, as object_store knows it).
    let azurite_url = format!("http://{}", azurite.addr);
    let emulator = [
        ("AZURE_STORAGE_USE_EMULATOR", "true"),
        ("AZURITE_BLOB_STORAGE_URL", azurite_url.as_str()),
        ("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT),
        ("AZURE_STORAGE_ACCOUNT_KEY", key.as_str()),
    ];
    for (name, env) in [("endpoint", &good[..]), ("emulator", &emulator[..])] {
        let dest = work.0.join(format!("dest-{name}"));
        let dest_arg = dest.display().to_string();
        let out = tokenway(
            &["pull", "org/tiny", "--origin", &origin, "--out", &dest_arg],
            env,
        );
        assert!(
            out.status.success(),
            "pull ({name}) failed: {}",
            stderr(&out)
        );
        for (rel, want) in &files {
            let got = std::fs::read(dest.join(rel)).expect("pulled file exists");
            assert!(
                got == *want,
                "{rel}: pulled bytes differ from published ({name})"
            );
        }
    }

    let fails = |origin: &str, env: &[(&str, &str)], want: &str| {
        let out_dir = work.0.join("fail");
        let out_arg = out_dir.display().to_string();
        let t = Instant::now();
        let out = tokenway(
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
    };
    // Another key for the same account: refused, and the message says what to check.
    let mut wrong = good;
    wrong[1] = ("AZURE_STORAGE_ACCOUNT_KEY", WRONG_KEY);
    fails(&origin, &wrong, "rejected the credentials");
    // A container that does not exist: not mistaken for a missing tag.
    fails("az://no-such-container/models", &good, "does not exist");
    // No credentials at all, or no account: refused before any request.
    fails(&origin, &good[2..], "no Azure credentials");
    fails(&origin, &good[1..], "no storage account");
    // A plain http endpoint without AZURE_ALLOW_HTTP.
    fails(&origin, &good[..3], "AZURE_ALLOW_HTTP");
    // Nothing listens on the endpoint.
    let closed = format!("http://127.0.0.1:{}/{ACCOUNT}", free_port());
    let mut unreachable = good;
    unreachable[2] = ("AZURE_STORAGE_ENDPOINT", closed.as_str());
    fails(&origin, &unreachable, "is the endpoint reachable");

    eprintln!("azure origin test took {:?}", started.elapsed());
}
