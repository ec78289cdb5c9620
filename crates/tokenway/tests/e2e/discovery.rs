//! DNS discovery: a real `tokenway gateway` follows the SRV records of a small DNS server that
//! the test runs on a loopback UDP port and changes while the gateway runs (a Kubernetes
//! headless service publishes the same records for its pods). The sims listen on distinct
//! ports of 127.0.0.1, which SRV records carry; A records, where every backend shares the
//! configured port, are covered by the gateway's unit tests.

use std::collections::{BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::{A, SRV};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use tokio::net::UdpSocket;

use crate::harness::*;

/// Records by (lower-case FQDN, type); the test edits it while the server runs.
type Zone = Arc<Mutex<HashMap<(String, RecordType), Vec<RData>>>>;

/// An authoritative responder: answers from `zone` with TTL 0, NXDOMAIN for unknown names.
async fn dns_server(zone: Zone) -> SocketAddr {
    let socket = UdpSocket::bind("127.0.0.1:0").await.expect("bind udp");
    let addr = socket.local_addr().expect("local addr");
    tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        loop {
            let Ok((n, peer)) = socket.recv_from(&mut buf).await else {
                return;
            };
            let Ok(query) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            let mut reply = Message::new();
            reply
                .set_id(query.id())
                .set_message_type(MessageType::Response)
                .set_op_code(query.op_code())
                .set_authoritative(true)
                .set_recursion_desired(query.recursion_desired());
            let zone = zone.lock().expect("zone lock").clone();
            let mut code = ResponseCode::NoError;
            for q in query.queries() {
                reply.add_query(q.clone());
                let name = q.name().to_lowercase().to_utf8();
                if !zone.keys().any(|(n, _)| *n == name) {
                    code = ResponseCode::NXDomain;
                }
                for rdata in zone.get(&(name, q.query_type())).into_iter().flatten() {
                    reply.add_answer(Record::from_rdata(q.name().clone(), 0, rdata.clone()));
                }
            }
            reply.set_response_code(code);
            if let Ok(bytes) = reply.to_vec() {
                let _ = socket.send_to(&bytes, peer).await;
            }
        }
    });
    addr
}

const SERVICE: &str = "_http._tcp.sims.tokenway.test.";

fn publish(zone: &Zone, sims: &[(&str, &Proc)]) {
    let mut z = zone.lock().expect("zone lock");
    let srv = sims
        .iter()
        .map(|(host, p)| {
            let target = Name::from_ascii(format!("{host}.sims.tokenway.test.")).expect("name");
            RData::SRV(SRV::new(0, 1, p.addr.port(), target))
        })
        .collect();
    z.insert((SERVICE.to_owned(), RecordType::SRV), srv);
    for (host, _) in sims {
        z.insert(
            (format!("{host}.sims.tokenway.test."), RecordType::A),
            vec![RData::A(A(Ipv4Addr::LOCALHOST))],
        );
    }
}

fn backend_of(r: &Reply) -> String {
    r.headers
        .get("x-tokenway-backend")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

#[tokio::test]
async fn dns_discovery_picks_up_an_added_and_a_removed_srv_backend() {
    let a = sim(FAST_SIM);
    let b = sim(FAST_SIM);
    let zone: Zone = Arc::default();
    publish(&zone, &[("a", &a)]);
    let ns = dns_server(zone.clone()).await;
    let gw = start_args_with_config(
        "gateway",
        &format!(
            "listen = \"127.0.0.1:0\"\n\
             [health]\nprobe_interval_ms = 200\n\
             [discovery]\nnameserver = \"{ns}\"\nrefresh_ms = 200\nmin_ttl_ms = 0\n\
             [[discovery.dns]]\nname = \"{SERVICE}\"\nrecord = \"srv\"\nmodels = [\"sim-model\"]\n"
        ),
    );
    let name = |host: &str, p: &Proc| format!("{host}.sims.tokenway.test:{}", p.addr.port());
    let url = format!("{}/v1/chat/completions", gw.url());
    let served_by = |url: String| async move {
        let mut names = BTreeSet::new();
        for i in 0..8 {
            let r = post(&url, &chat(&format!("dns{i}"), false, 1), None).await;
            if r.status == 200 {
                names.insert(backend_of(&r));
            } else {
                names.insert(format!("status {}", r.status));
            }
        }
        names.into_iter().collect::<Vec<_>>()
    };
    assert!(
        eventually(Duration::from_secs(5), || async {
            served_by(url.clone()).await == [name("a", &a)]
        })
        .await,
        "the SRV backend a was not discovered: {:?}",
        served_by(url.clone()).await
    );
    // Add b.
    publish(&zone, &[("a", &a), ("b", &b)]);
    let admin = format!("{}/admin/backends", gw.url());
    assert!(
        eventually(Duration::from_secs(5), || async {
            get(&admin).await.body.contains(&name("b", &b))
        })
        .await,
        "b was not added: {}",
        get(&admin).await.body
    );
    // Remove a: only b serves afterwards.
    publish(&zone, &[("b", &b)]);
    assert!(
        eventually(Duration::from_secs(5), || async {
            served_by(url.clone()).await == [name("b", &b)]
        })
        .await,
        "a was not removed: {:?}",
        served_by(url.clone()).await
    );
}
