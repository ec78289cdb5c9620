//! The `s3://` origin against a real S3-compatible server: moto's server (installed by
//! scripts/setup.sh from PyPI) on an ephemeral loopback port, with IAM authentication on so
//! wrong credentials are refused as AWS would. Real `tokenway publish` / `tokenway pull`
//! processes, configured only through the `AWS_*` environment variables.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Instant;

use crate::cloud_origin::{self, start_local_server, LocalServer};
use crate::harness::{python_has, TempDir};

const BUCKET: &str = "weights";

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("an ephemeral loopback port")
        .port()
}

/// Starts `python3 -m moto.server` on a free loopback port and waits until it accepts.
fn start_moto() -> LocalServer {
    start_local_server("moto's server", |port| {
        let mut c = Command::new("python3");
        c.args(["-m", "moto.server", "-H", "127.0.0.1", "-p"])
            .arg(port.to_string());
        c
    })
}

/// Creates the bucket and an IAM user allowed everything, then turns IAM authentication on
/// (moto's `/moto-api/reset-auth`); prints the user's key pair.
const SETUP_PY: &str = r#"
import json, sys, urllib.request
import boto3
ep, bucket = sys.argv[1], sys.argv[2]
kw = dict(endpoint_url=ep, region_name="us-east-1",
          aws_access_key_id="setup", aws_secret_access_key="setup")
boto3.client("s3", **kw).create_bucket(Bucket=bucket)
iam = boto3.client("iam", **kw)
iam.create_user(UserName="publisher")
iam.put_user_policy(UserName="publisher", PolicyName="all", PolicyDocument=json.dumps(
    {"Version": "2012-10-17",
     "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
key = iam.create_access_key(UserName="publisher")["AccessKey"]
urllib.request.urlopen(urllib.request.Request(
    ep + "/moto-api/reset-auth", data=b"0", method="POST",
    headers={"Content-Type": "application/octet-stream"})).read()
print(key["AccessKeyId"], key["SecretAccessKey"])
"#;

/// Lists the object keys of a bucket (authenticated with the given key pair).
const LIST_PY: &str = r#"
import sys, boto3
ep, bucket, key_id, secret = sys.argv[1:5]
s3 = boto3.client("s3", endpoint_url=ep, region_name="us-east-1",
                  aws_access_key_id=key_id, aws_secret_access_key=secret)
for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
    for o in page.get("Contents", []):
        print(o["Key"])
"#;

pub(crate) fn python(script: &str, args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "python helper failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `tokenway ARGS` with only the given `AWS_*` variables (none inherited).
fn tokenway(args: &[&str], aws: &[(&str, &str)]) -> Output {
    cloud_origin::tokenway(args, aws, &["AWS_"])
}

pub(crate) fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Deterministic pseudo-random bytes (xorshift), so the model is incompressible and the
/// test needs no extra crates.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// A small safetensors-like model: two multi-piece shards (one over S3's 5 MiB part minimum,
/// one under), a config, and an empty file.
pub(crate) fn write_model(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let header = br#"{"w":{"dtype":"F16","shape":[1024,1024],"data_offsets":[0,2097152]}}"#;
    let shard = |body_len: usize, seed: u64| {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header);
        b.extend_from_slice(&noise(body_len, seed));
        b
    };
    let files = vec![
        (
            "model-00001-of-00002.safetensors".to_string(),
            shard(6 * 1024 * 1024 + 12_345, 7),
        ),
        (
            "shards/model-00002-of-00002.safetensors".to_string(),
            shard(1024 * 1024 + 999, 11),
        ),
        (
            "config.json".to_string(),
            br#"{"architectures":["Tiny"],"hidden_size":1024}"#.to_vec(),
        ),
        ("empty.txt".to_string(), Vec::new()),
    ];
    for (rel, bytes) in &files {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().expect("a file has a parent")).expect("mkdir");
        std::fs::write(&p, bytes).expect("model file is writable");
    }
    files
}

#[test]
fn s3_origin_publish_then_pull_is_byte_identical_and_bad_access_fails_clearly() {
    if !python_has("moto.server") || !python_has("boto3") {
        return;
    }
    let started = Instant::now();
    let moto = start_moto();
    let endpoint = format!("http://{}", moto.addr);
    let keys = python(SETUP_PY, &[&endpoint, BUCKET]);
    let (key_id, secret) = keys
        .trim()
        .split_once(' ')
        .expect("setup prints a key pair");
    let good = [
        ("AWS_ACCESS_KEY_ID", key_id),
        ("AWS_SECRET_ACCESS_KEY", secret),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT_URL", endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
    ];

    let work = TempDir::new("s3");
    let origin = format!("s3://{BUCKET}/models/v1");
    let files = cloud_origin::publish_twice(&tokenway, &good, &work.0, &origin);
    // Everything landed under the prefix, content addressed.
    let listed = python(LIST_PY, &[&endpoint, BUCKET, key_id, secret]);
    cloud_origin::assert_published_listing(&listed.lines().collect::<Vec<_>>());
    cloud_origin::pull_and_compare(&tokenway, &good, &origin, &work.0.join("dest"), &files);

    let fails = |origin: &str, aws: &[(&str, &str)], want: &str| {
        cloud_origin::assert_pull_fails(&tokenway, aws, origin, &work.0.join("fail"), want)
    };
    // Wrong key pair: the server refuses it; the message says to check the credentials.
    let mut wrong = good;
    wrong[0] = ("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0");
    fails(&origin, &wrong, "rejected the credentials");
    // Missing bucket: not mistaken for a missing tag.
    fails("s3://no-such-bucket/models", &good, "does not exist");
    // No credentials at all: refused before any request.
    fails(&origin, &good[2..], "no AWS credentials");
    // Plain http endpoint without AWS_ALLOW_HTTP.
    fails(&origin, &good[..4], "AWS_ALLOW_HTTP");
    // Unreachable endpoint (nothing listens on this port).
    let closed = format!("http://127.0.0.1:{}", free_port());
    let mut unreachable = good;
    unreachable[3] = ("AWS_ENDPOINT_URL", closed.as_str());
    fails(&origin, &unreachable, "is the endpoint reachable");
    // A scheme no origin supports.
    fails("gs://bucket/x", &good, "unsupported scheme gs://");

    eprintln!("s3 origin test took {:?}", started.elapsed());
}
