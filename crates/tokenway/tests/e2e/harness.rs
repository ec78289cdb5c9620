//! Starting processes and talking to them.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// A child process killed on drop.
pub struct Proc {
    pub child: Child,
    pub addr: SocketAddr,
    /// The TLS listener, when the process has one.
    pub tls_addr: Option<SocketAddr>,
    /// Other announced addresses by kind (`h3`, `tunnel`), and the certificate fingerprint.
    pub extras: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
    _dir: Option<TempDir>,
}

impl Proc {
    /// Kills the process at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// An announced address (`h3`, `tunnel` and `tunnel-tcp`), waiting briefly for its line.
    pub fn extra(&self, kind: &str) -> Option<SocketAddr> {
        self.extra_field(kind, 0)?.parse().ok()
    }

    /// The fingerprint announced with the tunnel address.
    pub fn fingerprint(&self) -> Option<String> {
        self.extra_field("tunnel", 2)
    }

    fn extra_field(&self, kind: &str, field: usize) -> Option<String> {
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            {
                let extras = self.extras.lock().expect("extras lock");
                if let Some((_, v)) = extras.iter().find(|(k, _)| k == kind) {
                    return v.split_whitespace().nth(field).map(|s| {
                        let s = s.trim_start_matches("udp://");
                        s.trim_start_matches("tcp://").to_string()
                    });
                }
            }
            if Instant::now() > end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("tokenway-e2e-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir is creatable");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_tokenway")
}

/// Starts `tokenway <role> --config FILE --listen 127.0.0.1:0` and waits for its
/// `listening on http://ADDR` line.
fn start(role: &str, toml: &str, extra: &[&str], want_tls: bool) -> Proc {
    start_inner(role, Some(toml), extra, want_tls)
}

fn start_inner(role: &str, toml: Option<&str>, extra: &[&str], want_tls: bool) -> Proc {
    start_in(None, role, toml, extra, want_tls)
}

/// Starts `tokenway ROLE` inside network namespace `ns` (`ip netns exec`, which execs, so the
/// child is the tokenway process itself), or in this one with `None`.
pub fn start_in(
    ns: Option<&str>,
    role: &str,
    toml: Option<&str>,
    extra: &[&str],
    want_tls: bool,
) -> Proc {
    let dir = TempDir::new(role);
    let mut config_args = Vec::new();
    if let Some(toml) = toml {
        let path = dir.0.join(format!("{role}.toml"));
        std::fs::write(&path, toml).expect("config is writable");
        config_args.push("--config".to_string());
        config_args.push(path.display().to_string());
    }
    let mut command = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, bin()]);
            c
        }
        None => Command::new(bin()),
    };
    let mut child = command
        .arg(role)
        .args(&config_args)
        .args(extra)
        // TOKENWAY_TEST_LOG (a RUST_LOG filter) makes the processes say more when a test is
        // being looked into.
        .env(
            "RUST_LOG",
            std::env::var("TOKENWAY_TEST_LOG").unwrap_or_else(|_| "warn".to_string()),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("tokenway binary starts");
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    let extras = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let extras_writer = extras.clone();
    std::thread::spawn(move || {
        // Keep draining stdout so the child never blocks on a full pipe.
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listening on ").nth(1) {
                let _ = tx.send(rest.trim().to_string());
            }
            for kind in ["h3", "tunnel", "tunnel-tcp"] {
                if let Some(rest) = line.split(&format!(" {kind} on ")).nth(1) {
                    if let Ok(mut e) = extras_writer.lock() {
                        e.push((kind.to_string(), rest.trim().to_string()));
                    }
                }
            }
        }
    });
    let mut addr = None;
    let mut tls_addr = None;
    let deadline = Instant::now() + Duration::from_secs(20);
    while addr.is_none() || (want_tls && tls_addr.is_none()) {
        let left = deadline.saturating_duration_since(Instant::now());
        let url = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("tokenway {role} did not report its address"));
        if let Some(a) = url.strip_prefix("http://") {
            addr = Some(a.parse().expect("a socket address"));
        } else if let Some(a) = url.strip_prefix("https://") {
            tls_addr = Some(a.parse().expect("a socket address"));
        }
    }
    Proc {
        child,
        addr: addr.expect("loop ends with an address"),
        tls_addr,
        extras,
        _dir: Some(dir),
    }
}

/// Starts `tokenway ARGS...` (no generated config) and waits for its address line.
pub fn start_args(args: &[&str], want_tls: bool) -> Proc {
    let (role, rest) = args.split_first().expect("a role");
    start_inner(role, None, rest, want_tls)
}

/// Starts `tokenway ROLE --config FILE` with `toml` as the file.
pub fn start_args_with_config(role: &str, toml: &str) -> Proc {
    start(role, toml, &[], false)
}

/// Starts a simulated backend with `toml` (SimConfig keys).
pub fn sim(toml: &str) -> Proc {
    start("sim", toml, &["--listen", "127.0.0.1:0"], false)
}

/// Starts a simulated backend on a given address (to bring a killed one back).
pub fn sim_at(addr: SocketAddr, toml: &str) -> Proc {
    start("sim", toml, &["--listen", &addr.to_string()], false)
}

/// Starts a gateway in front of `backends` with extra top-level TOML `extra` (keys before the
/// first table) and `tables` (appended after the backends).
pub fn gateway(backends: &[&Proc], extra: &str, tables: &str) -> Proc {
    let mut toml = format!("listen = \"127.0.0.1:0\"\n{extra}\n{tables}\n");
    for (i, b) in backends.iter().enumerate() {
        toml.push_str(&format!(
            "[[backends]]\nname = \"b{i}\"\nurl = \"{}\"\nmodels = [\"sim-model\"]\n",
            b.url()
        ));
    }
    start("gateway", &toml, &[], extra.contains("tls_listen"))
}

/// Fast sim timing for functional tests.
pub const FAST_SIM: &str = "base_latency_ms = 1.0\ntime_per_output_token_ms = 2.0\n";

/// A pooled HTTP/1.1 client.
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(c)
}

/// A collected response.
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: String,
}

/// POSTs JSON and collects the answer.
pub async fn post(url: &str, body: &str, key: Option<&str>) -> Reply {
    post_on(&client(), url, body, key).await
}

/// POSTs JSON over h2c (HTTP/2 with prior knowledge) and collects the answer.
pub async fn post_h2c(url: &str, body: &str) -> Reply {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    let h2c = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(c);
    post_on(&h2c, url, body, None).await
}

async fn post_on(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    body: &str,
    key: Option<&str>,
) -> Reply {
    let mut req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("valid request");
    if let Some(k) = key {
        req.headers_mut().insert(
            "authorization",
            format!("Bearer {k}").parse().expect("header"),
        );
    }
    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .expect("answered in time")
        .expect("request succeeds");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = tokio::time::timeout(Duration::from_secs(20), resp.into_body().collect())
        .await
        .expect("body in time")
        .expect("body readable")
        .to_bytes();
    Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// GETs a URL and collects the answer.
pub async fn get(url: &str) -> Reply {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .expect("valid request");
    let resp = client().request(req).await.expect("request succeeds");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// Sends `head` (a request head announcing a large body behind `Expect: 100-continue`) to `addr`
/// on a raw connection and returns the first answer bytes, which must come without the body.
pub async fn answer_to_head(addr: SocketAddr, head: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut raw = tokio::net::TcpStream::connect(addr).await.expect("connect");
    raw.write_all(head).await.expect("write");
    let mut answer = vec![0u8; 2048];
    let n = tokio::time::timeout(Duration::from_secs(5), raw.read(&mut answer))
        .await
        .expect("an answer without the body")
        .expect("read");
    String::from_utf8_lossy(&answer[..n]).into_owned()
}

/// A connection that sent a chat request's head declaring a body of `len` bytes with
/// `Expect: 100-continue` (and `extra` header lines), and was invited to send it.
pub async fn invited_to_send(addr: SocketAddr, len: usize, extra: &str) -> tokio::net::TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {len}\r\nexpect: 100-continue\r\n{extra}\r\n"
    );
    s.write_all(head.as_bytes()).await.expect("write");
    let mut invited = vec![0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut invited))
        .await
        .expect("invited in time")
        .expect("read");
    let invited = String::from_utf8_lossy(&invited[..n]);
    assert!(invited.starts_with("HTTP/1.1 100 Continue"), "{invited}");
    s
}

/// The connection `holder`, whose body was sent but for `rest`, sends it: its answer is a 200,
/// and its bytes held are given back (a 50 000-byte request to `chat_url` fits again).
pub async fn holder_completes(mut holder: tokio::net::TcpStream, rest: &[u8], chat_url: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    holder.write_all(rest).await.expect("write");
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), holder.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let r = post(chat_url, &chat_of_len(50_000), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A non-streaming chat request body of exactly `len` bytes (its prompt padded with `y`).
pub fn chat_of_len(len: usize) -> String {
    let body = chat(&"y".repeat(len), false, 2);
    let pad = len - (body.len() - len);
    chat(&"y".repeat(pad), false, 2)
}

/// A chat request body.
pub fn chat(prompt: &str, stream: bool, max_tokens: u32) -> String {
    serde_json::json!({
        "model": "sim-model",
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
    })
    .to_string()
}

/// The `data:` payloads of an SSE body, in order.
pub fn data_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| {
            e.lines()
                .find_map(|l| l.strip_prefix("data:").map(|d| d.trim().to_string()))
        })
        .collect()
}

/// Drops the per-request fields (`id`, `created`) so two answers to one prompt compare equal.
pub fn normalize(event: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(event) {
        Ok(mut v) => {
            if let Some(o) = v.as_object_mut() {
                o.remove("id");
                o.remove("created");
            }
            v.to_string()
        }
        Err(_) => event.to_string(),
    }
}

/// Reads a counter or gauge value from Prometheus text (sum over series matching `prefix`).
pub fn metric_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Whether `gw`'s backend `b0` has no request in flight within `within` (its
/// `tokenway_backend_inflight` gauge at 0).
pub async fn b0_released(gw: &Proc, within: Duration) -> bool {
    let metrics = format!("{}/metrics", gw.url());
    eventually(within, || async {
        metric_sum(
            &get(&metrics).await.body,
            "tokenway_backend_inflight{backend=\"b0\"",
        ) == 0.0
    })
    .await
}

/// Polls `check` every 50 ms until it holds or `within` passes.
pub async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + within;
    while Instant::now() < end {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The `/metrics` text at `url` once `series` sums to at least `at_least` (or after 5 s, for
/// the assertion to show). A role reports an answer's end once its connection is done with
/// the last byte, so a scrape on another connection may come a moment early.
pub async fn metrics_reaching(url: &str, series: &str, at_least: f64) -> String {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let text = get(&format!("{url}/metrics")).await.body;
        if metric_sum(&text, series) >= at_least || Instant::now() > end {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts an edge with `toml` (EdgeConfig keys; `--listen 127.0.0.1:0` overrides `listen`) and
/// waits for its `listening on http://ADDR` line.
pub fn edge(toml: &str) -> Proc {
    start("edge", toml, &["--listen", "127.0.0.1:0"], false)
}

/// Whether `python3 -c "import MODULE"` works; outside CI (no `TOKENWAY_REQUIRE_PYTHON`) a
/// missing module makes the caller skip, in CI it fails the test.
pub fn python_has(module: &str) -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        assert!(
            std::env::var_os("TOKENWAY_REQUIRE_PYTHON").is_none(),
            "TOKENWAY_REQUIRE_PYTHON is set but `import {module}` fails"
        );
        eprintln!(
            "SKIP: the `{module}` Python package is not installed (scripts/setup.sh installs it)"
        );
    }
    ok
}

/// Whether the command `cmd` runs (`cmd --version`); otherwise prints SKIP, or fails when
/// `TOKENWAY_REQUIRE_PYTHON` is set (as `scripts/test.sh` does: setup.sh installs the tools).
pub fn command_has(cmd: &str) -> bool {
    let ok = std::process::Command::new(cmd)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("TOKENWAY_REQUIRE_PYTHON").is_none(),
            "TOKENWAY_REQUIRE_PYTHON is set but `{cmd} --version` fails (scripts/setup.sh \
             installs it)"
        );
        eprintln!("SKIP: `{cmd}` is not installed (scripts/setup.sh installs it)");
    }
    ok
}

/// Runs tests/python/openai_client.py against `api` (an OpenAI base URL ending in /v1),
/// comparing with `backend`'s own answers, with API key `key`.
pub fn openai_check(api: &str, backend: &str, key: &str) {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/openai_client.py"
    );
    let out = std::process::Command::new("python3")
        .arg(script)
        .args(["--gateway", api, "--backend", backend, "--key", key])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "openai client check against {api} failed:\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A tunnel stack in a netlab lab: sim and gateway (tunnel port on the server's lab address) in
/// the server namespace, an edge pinned to the gateway in the client namespace.
pub struct LabStack {
    pub sim: Proc,
    pub gateway: Proc,
    pub edge: Proc,
}

/// Starts a [`LabStack`]: `gateway_tables` follow the gateway's `[tunnel]` table (e.g.
/// `[tunnel.datagram]`), `edge_tables` follow the edge's `[[gateways]]` entry (e.g. `[quic]`).
pub fn lab_stack(
    lab: &tokenway_netlab::Lab,
    token: &str,
    sim_toml: &str,
    gateway_tables: &str,
    edge_tables: &str,
) -> LabStack {
    let server_ns = lab.namespace(tokenway_netlab::SERVER);
    let client_ns = lab.namespace(tokenway_netlab::CLIENT);
    let server_ip = lab
        .address(tokenway_netlab::SERVER)
        .expect("server address");
    let sim = start_in(
        Some(&server_ns),
        "sim",
        Some(sim_toml),
        &["--listen", "127.0.0.1:0"],
        false,
    );
    let gateway = start_in(
        Some(&server_ns),
        "gateway",
        Some(&format!(
            "listen = \"127.0.0.1:0\"\n\
             [[backends]]\nurl = \"{}\"\nmodels = [\"sim-model\"]\n\
             [tunnel]\nlisten = \"{server_ip}:0\"\ntokens = [\"{token}\"]\n\
             {gateway_tables}\n",
            sim.url()
        )),
        &[],
        false,
    );
    let tunnel = gateway
        .extra("tunnel")
        .expect("the gateway reports its tunnel port");
    let pin = gateway
        .fingerprint()
        .expect("the gateway reports its fingerprint");
    let edge = start_in(
        Some(&client_ns),
        "edge",
        Some(&format!(
            "listen = \"127.0.0.1:0\"\n\
             token = \"{token}\"\n\
             [trust]\npin_sha256 = [\"{pin}\"]\n\
             [[gateways]]\nname = \"gw\"\nquic = \"{tunnel}\"\nserver_name = \"localhost\"\n\
             {edge_tables}\n"
        )),
        &[],
        false,
    );
    LabStack { sim, gateway, edge }
}

/// Tests that load both CPUs (hundreds of MB hashed and copied), run a netlab emulator or
/// measure throughput take turns: on a 2-core machine two at once starve each other's timing.
/// Async tests `.lock().await`, plain ones `blocking_lock()`.
pub static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The edge's quinn-based HTTP/3 client connected to `addr` (one of `gw`'s QUIC ports),
/// trusting the certificate the gateway announced, with its endpoint (a quinn `Endpoint`,
/// which this crate does not name) to keep while the client is used; or why it could not
/// connect.
pub async fn quic_client_at(
    gw: &Proc,
    addr: SocketAddr,
) -> Result<
    (
        tokenway_transport::client::QuicClient,
        Box<dyn std::any::Any>,
    ),
    tokenway_transport::TransportError,
> {
    use tokenway_transport::client::{QuicClient, QuicConnect};
    use tokenway_transport::trust::{client_tls, Trust};
    use tokenway_transport::QuicSettings;

    let pin = gw
        .fingerprint()
        .expect("the gateway reports its fingerprint");
    let settings = QuicSettings {
        zero_rtt: false,
        ..QuicSettings::default()
    };
    let endpoint = tokenway_transport::endpoint::client_endpoint(
        "127.0.0.1:0".parse().expect("addr"),
        &settings,
    )
    .expect("client endpoint");
    let tls = client_tls(
        &Trust::Pinned(vec![pin]),
        &[tokenway_transport::ALPN_H3],
        false,
    )
    .expect("client TLS");
    let client = QuicClient::connect(QuicConnect {
        endpoint: &endpoint,
        addr,
        server_name: "localhost",
        tls,
        settings: &settings,
        initial_rtt: None,
        peer: "test",
        metrics: None,
        timeout: Duration::from_secs(5),
    })
    .await?;
    Ok((client, Box::new(endpoint)))
}
