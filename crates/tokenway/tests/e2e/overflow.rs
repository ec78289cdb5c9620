//! Overflow to a peer gateway: a gateway whose own backends cannot take a request sends it
//! through the tunnel to a peer region's gateway and streams the answer back; a request that
//! already overflowed once is never sent on again.

use crate::harness::*;

const TOKEN: &str = "e2e-overflow-token-0123456789";

/// A TCP port with nothing listening (bound, then released).
fn dead_backend_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    format!("http://{addr}")
}

/// The peer region's gateway: `backend` behind it, its tunnel open to [`TOKEN`].
fn peer_gateway(backend: &Proc) -> Proc {
    gateway(
        &[backend],
        "",
        &format!("[tunnel]\nlisten = \"127.0.0.1:0\"\ntokens = [\"{TOKEN}\"]\n"),
    )
}

/// A gateway whose only backend is dead and whose `[overflow]` points at `peer`'s tunnel.
fn gateway_overflowing_to(peer: &Proc) -> Proc {
    let quic = peer.extra("tunnel").expect("the peer announces its tunnel");
    let pin = peer
        .fingerprint()
        .expect("the peer announces its fingerprint");
    start_args_with_config(
        "gateway",
        &format!(
            "listen = \"127.0.0.1:0\"\n\
             [[backends]]\nname = \"local\"\nurl = \"{}\"\nmodels = [\"sim-model\"]\n\
             [overflow]\ntoken = \"{TOKEN}\"\n\
             [overflow.trust]\npin_sha256 = [\"{pin}\"]\n\
             [[overflow.gateways]]\nname = \"peer\"\nquic = \"{quic}\"\nserver_name = \"localhost\"\n",
            dead_backend_url()
        ),
    )
}

#[tokio::test]
async fn with_no_local_backend_a_request_overflows_to_the_peer_region() {
    let backend = sim(FAST_SIM);
    let peer = peer_gateway(&backend);
    let local = gateway_overflowing_to(&peer);
    let body = chat("overflow me", true, 12);
    let via = post(&format!("{}/v1/chat/completions", local.url()), &body, None).await;
    assert_eq!(via.status, 200, "{}", via.body);
    let direct = post(
        &format!("{}/v1/chat/completions", backend.url()),
        &body,
        None,
    )
    .await;
    let events = |b: &str| {
        data_events(b)
            .iter()
            .map(|e| normalize(e))
            .collect::<Vec<_>>()
    };
    assert_eq!(events(&via.body), events(&direct.body));

    let metrics = get(&format!("{}/metrics", local.url())).await.body;
    assert_eq!(
        metric_sum(
            &metrics,
            "tokenway_requests_total{route=\"/v1/chat/completions\",backend=\"overflow:peer\",status=\"200\"}"
        ),
        1.0,
        "{metrics}"
    );
    let peer_metrics = get(&format!("{}/metrics", peer.url())).await.body;
    assert!(
        metric_sum(
            &peer_metrics,
            "tokenway_requests_total{route=\"/v1/chat/completions\",backend=\"b0\",status=\"200\"}"
        ) >= 1.0,
        "the peer's own backend served it: {peer_metrics}"
    );
}

#[tokio::test]
async fn a_request_that_already_overflowed_is_not_sent_on_again() {
    let backend = sim(FAST_SIM);
    let peer = peer_gateway(&backend);
    let local = gateway_overflowing_to(&peer);
    // As if it came from another gateway's overflow: it must stop here, with a local error.
    let r = hyper_post_with_header(
        &format!("{}/v1/chat/completions", local.url()),
        &chat("no ping-pong", true, 4),
        ("tw-overflow", "1"),
    )
    .await;
    assert!(r.0 == 502 || r.0 == 503, "status {}: {}", r.0, r.1);
    let metrics = get(&format!("{}/metrics", local.url())).await.body;
    assert!(
        !metrics.contains("backend=\"overflow:peer\""),
        "it overflowed anyway: {metrics}"
    );
}

#[tokio::test]
async fn with_the_peer_region_down_an_unservable_request_gets_this_regions_503() {
    let backend = sim(FAST_SIM);
    let peer = peer_gateway(&backend);
    let local = gateway_overflowing_to(&peer);
    drop(peer);
    // The dead local backend is ejected by the first attempt (or its probes); from then on no
    // backend here is healthy and the peer cannot be reached: the answer is this region's
    // 503 with Retry-After, which clients retry, not the tunnel's 502.
    let mut last = None;
    for _ in 0..3 {
        let r = hyper_post_with_header(
            &format!("{}/v1/chat/completions", local.url()),
            &chat("nowhere to go", true, 4),
            ("x-test", "1"),
        )
        .await;
        let done = r.0 == 503;
        last = Some(r);
        if done {
            break;
        }
    }
    let (status, body) = last.expect("answered");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("no_healthy_backend"), "{body}");
}

/// POST with one extra header; (status, body).
async fn hyper_post_with_header(url: &str, body: &str, header: (&str, &str)) -> (u16, String) {
    use http_body_util::BodyExt;
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .header(header.0, header.1)
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .expect("request");
    let resp = client().request(req).await.expect("response");
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}
