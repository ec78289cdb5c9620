//! The `az://` origin against a real Azure Blob Storage API: Azurite (installed by
//! scripts/setup.sh from npm) on an ephemeral loopback port with an account and key of the
//! test's own, the container created and listed with the official `azure-storage-blob` Python
//! SDK. Real `tokenway publish` / `tokenway pull` processes, configured only through the
//! `AZURE_*` environment variables.

use std::process::{Command, Output};
use std::time::Instant;

use crate::cloud_origin::{self, start_local_server, LocalServer};
use crate::harness::{command_has, python_has, TempDir};
use crate::s3::{free_port, python};

const ACCOUNT: &str = "weightsacct";
const CONTAINER: &str = "weights";

/// The account's blob endpoint on `azurite` (Azurite puts the account in the path).
fn endpoint(azurite: &LocalServer) -> String {
    format!("http://{}/{ACCOUNT}", azurite.addr)
}

/// Starts `azurite-blob` (in memory) on a free loopback port with one account, `key`.
fn start_azurite(key: &str) -> LocalServer {
    start_local_server("azurite-blob", |port| {
        let mut c = Command::new("azurite-blob");
        c.args(["--blobHost", "127.0.0.1", "--blobPort"])
            .arg(port.to_string())
            .args(["--inMemoryPersistence", "--silent", "--skipApiVersionCheck"])
            .env("AZURITE_ACCOUNTS", format!("{ACCOUNT}:{key}"));
        c
    })
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
    cloud_origin::tokenway(args, azure, &["AZURE_", "AZURITE_", "MSI_ENDPOINT"])
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
    let endpoint = endpoint(&azurite);
    python(CREATE_PY, &[&endpoint, ACCOUNT, &key, CONTAINER]);
    let good = [
        ("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT),
        ("AZURE_STORAGE_ACCOUNT_KEY", key.as_str()),
        ("AZURE_STORAGE_ENDPOINT", endpoint.as_str()),
        ("AZURE_ALLOW_HTTP", "true"),
    ];

    let work = TempDir::new("azure");
    let origin = format!("az://{CONTAINER}/models/v1");
    let files = cloud_origin::publish_twice(&tokenway, &good, &work.0, &origin);
    // Everything landed under the prefix, content addressed, as the Azure SDK sees it.
    let listed = python(LIST_PY, &[&endpoint, ACCOUNT, &key, CONTAINER]);
    cloud_origin::assert_published_listing(&listed.lines().collect::<Vec<_>>());

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
        cloud_origin::pull_and_compare(&tokenway, env, &origin, &dest, &files);
    }

    let fails = |origin: &str, env: &[(&str, &str)], want: &str| {
        cloud_origin::assert_pull_fails(&tokenway, env, origin, &work.0.join("fail"), want)
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
