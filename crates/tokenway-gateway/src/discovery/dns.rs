//! Backend discovery from DNS: every `[[discovery.dns]]` name is resolved every
//! `discovery.refresh_ms`, and the backends it names go through the same path as the file
//! discovery's ([`Shared::add_backend`] + a probe task, [`Shared::remove_backend`]).
//!
//! - `record = "a"`: the A and AAAA records of the name, one backend per address, all on the
//!   entry's `port`; the backend is named `ip:port`.
//! - `record = "srv"`: one backend per SRV (target, port), the target resolved to its first
//!   address; the backend is named `target:port`, so a pod that comes back with a new address
//!   keeps its name (and its rendezvous-hashed sessions) and only its URL changes. SRV priority
//!   and weight are not used: the router weighs backends by what it measures.
//!
//! This is what a Kubernetes headless service publishes (A records per ready pod, SRV records
//! per named port), so pointing an entry at one follows its pods.
//!
//! **Caching and TTL.** The resolver caches answers for their TTL, so a change is seen within
//! about max(`refresh_ms`, TTL); TTLs below `min_ttl_ms` are raised to it, which bounds the
//! query rate of many gateways to a zone that publishes TTL 0.
//!
//! **Failures never empty the pool by accident.** A name that does not exist or has no records
//! (an authoritative answer) yields no backends, so its backends are removed: that is how a
//! service scaled to zero looks. A timeout, a refused query or a server failure keeps the
//! name's current backends until a later refresh succeeds; so does an SRV target whose address
//! cannot be resolved for such a reason.
//!
//! Backends of the main config and of the `backends_file` are never touched; a DNS backend
//! whose name one of them already uses is skipped with a warning. The gateway's backend
//! `Source` has no DNS variant yet, so DNS backends are registered as `Source::Static`, which
//! keeps the file discovery's hands off them; this module keeps its own list of what it added.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::config::{
    LookupIpStrategy, NameServerConfigGroup, ResolveHosts, ResolverConfig,
};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::{ResolveError, TokioResolver};
use tokenway_router::BackendId;
use tokio::sync::watch;

use crate::config::{BackendConfig, DiscoverySettings, DnsBackends, DnsRecord};
use crate::probe;
use crate::state::{Shared, Source};

/// One backend this module added.
#[derive(Debug, Clone)]
struct Owned {
    /// Index of the `[[discovery.dns]]` entry that named it.
    entry: usize,
    id: BackendId,
    url: String,
}

/// Builds the resolver of `settings`: its `nameserver`, or the system's configuration.
pub fn resolver(settings: &DiscoverySettings) -> Result<TokioResolver, ResolveError> {
    let mut builder = match settings.nameserver {
        Some(addr) => {
            let servers = NameServerConfigGroup::from_ips_clear(&[addr.ip()], addr.port(), true);
            let mut b = TokioResolver::builder_with_config(
                ResolverConfig::from_parts(None, Vec::new(), servers),
                TokioConnectionProvider::default(),
            );
            // An explicit server is the whole truth: do not mix in /etc/hosts.
            b.options_mut().use_hosts_file = ResolveHosts::Never;
            b
        }
        None => TokioResolver::builder_tokio()?,
    };
    let opts = builder.options_mut();
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    opts.timeout = Duration::from_millis(settings.timeout_ms);
    opts.attempts = 2;
    let min_ttl = Duration::from_millis(settings.min_ttl_ms);
    opts.positive_min_ttl = Some(min_ttl);
    opts.negative_min_ttl = Some(min_ttl);
    Ok(builder.build())
}

/// Resolves every name until `stop` fires.
pub async fn run(shared: Arc<Shared>, stop: watch::Receiver<bool>) {
    let settings = shared.config.discovery.clone();
    if settings.dns.is_empty() {
        return;
    }
    let mut stop_changed = stop.clone();
    let mut owned: HashMap<String, Owned> = HashMap::new();
    let mut resolver_cell: Option<TokioResolver> = None;
    loop {
        if resolver_cell.is_none() {
            match resolver(&settings) {
                Ok(r) => resolver_cell = Some(r),
                Err(e) => tracing::warn!(error = %e, "cannot set up the DNS resolver; retrying"),
            }
        }
        if let Some(r) = &resolver_cell {
            refresh(&shared, r, &settings.dns, &mut owned, &stop).await;
        }
        tokio::select! {
            _ = tokio::time::sleep(settings.refresh()) => {}
            _ = stop_changed.changed() => return,
        }
    }
}

/// Resolves every entry once and applies the differences.
async fn refresh(
    shared: &Arc<Shared>,
    resolver: &TokioResolver,
    entries: &[DnsBackends],
    owned: &mut HashMap<String, Owned>,
    stop: &watch::Receiver<bool>,
) {
    let results =
        futures_util::future::join_all(entries.iter().map(|e| resolve(resolver, e))).await;
    // name -> (entry, backend); a name claimed by two entries stays with the first.
    let mut wanted: BTreeMap<String, (usize, BackendConfig)> = BTreeMap::new();
    for (i, (entry, result)) in entries.iter().zip(results).enumerate() {
        match result {
            Ok(backends) => {
                for b in backends {
                    wanted.entry(b.display_name()).or_insert((i, b));
                }
            }
            Err(e) => {
                tracing::warn!(name = %entry.name, error = %e, "DNS discovery failed; keeping this name's backends");
                for (name, o) in owned.iter().filter(|(_, o)| o.entry == i) {
                    let mut keep = backend(entry, o.url.clone());
                    keep.name = Some(name.clone());
                    wanted.entry(name.clone()).or_insert((i, keep));
                }
            }
        }
    }
    let current: HashMap<String, String> = owned
        .iter()
        .map(|(n, o)| (n.clone(), o.url.clone()))
        .collect();
    let (remove, add) = diff(&current, wanted.iter().map(|(n, (_, b))| (n, &b.url)));
    for name in remove {
        if let Some(o) = owned.remove(&name) {
            tracing::info!(backend = %name, "backend removed by DNS discovery");
            shared.remove_backend(o.id);
        }
    }
    if add.is_empty() {
        return;
    }
    let others: HashSet<String> = shared
        .live_upstreams()
        .into_iter()
        .map(|(_, u)| u.name.clone())
        .filter(|n| !owned.contains_key(n))
        .collect();
    for name in add {
        let Some((entry, b)) = wanted.get(&name) else {
            continue;
        };
        if others.contains(&name) {
            tracing::warn!(backend = %name, "DNS names a backend that is already configured; ignored");
            continue;
        }
        match shared.add_backend(b, Source::Static) {
            Ok(id) => {
                tracing::info!(backend = %name, url = %b.url, "backend added by DNS discovery");
                tokio::spawn(probe::run(shared.clone(), id, stop.clone()));
                owned.insert(
                    name,
                    Owned {
                        entry: *entry,
                        id,
                        url: b.url.clone(),
                    },
                );
            }
            Err(e) => tracing::warn!(backend = %name, error = %e, "cannot add backend"),
        }
    }
}

/// Names to remove (gone, or their URL changed) and names to add (new, or their URL changed).
fn diff<'a>(
    current: &HashMap<String, String>,
    wanted: impl Iterator<Item = (&'a String, &'a String)>,
) -> (Vec<String>, Vec<String>) {
    let wanted: HashMap<&String, &String> = wanted.collect();
    let mut remove: Vec<String> = current
        .iter()
        .filter(|(name, url)| wanted.get(name) != Some(url))
        .map(|(name, _)| name.clone())
        .collect();
    let mut add: Vec<String> = wanted
        .iter()
        .filter(|(name, url)| current.get(name.as_str()) != Some(url))
        .map(|(name, _)| (*name).clone())
        .collect();
    remove.sort();
    add.sort();
    (remove, add)
}

/// The backend entry for `url` with the settings of `entry` (name from the URL).
fn backend(entry: &DnsBackends, url: String) -> BackendConfig {
    BackendConfig {
        name: None,
        url,
        region: entry.region.clone(),
        models: entry.models.clone(),
        max_inflight: entry.max_inflight,
        api_key: entry.api_key.clone(),
        prefix_capacity_blocks: entry.prefix_capacity_blocks,
        health_path: None,
    }
}

fn url_of(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("http://{v4}:{port}"),
        IpAddr::V6(v6) => format!("http://[{v6}]:{port}"),
    }
}

/// An answer that says "nothing here" (as opposed to "could not ask").
fn is_empty_answer(e: &ResolveError) -> bool {
    e.is_nx_domain() || e.is_no_records_found()
}

/// The backends `entry` names now. `Ok(empty)` when the name has no such records; `Err` when
/// the question could not be answered.
pub async fn resolve(
    resolver: &TokioResolver,
    entry: &DnsBackends,
) -> Result<Vec<BackendConfig>, ResolveError> {
    match entry.record {
        DnsRecord::A => {
            // Validated: `a` entries have a port.
            let port = entry.port.unwrap_or_default();
            let ips = match resolver.lookup_ip(entry.name.as_str()).await {
                Ok(found) => found.iter().collect::<Vec<_>>(),
                Err(e) if is_empty_answer(&e) => Vec::new(),
                Err(e) => return Err(e),
            };
            let mut out: Vec<BackendConfig> = ips
                .into_iter()
                .map(|ip| backend(entry, url_of(ip, port)))
                .collect();
            out.sort_by(|a, b| a.url.cmp(&b.url));
            out.dedup_by(|a, b| a.url == b.url);
            Ok(out)
        }
        DnsRecord::Srv => {
            let records = match resolver.srv_lookup(entry.name.as_str()).await {
                Ok(found) => found
                    .iter()
                    .map(|srv| (srv.target().clone(), srv.port()))
                    .collect::<Vec<_>>(),
                Err(e) if is_empty_answer(&e) => Vec::new(),
                Err(e) => return Err(e),
            };
            let mut out = Vec::with_capacity(records.len());
            for (target, port) in records {
                // RFC 2782: a target of "." means the service is decidedly not available here.
                if target.is_root() || port == 0 {
                    continue;
                }
                let ip = match resolver.lookup_ip(target.clone()).await {
                    Ok(found) => found.iter().next(),
                    Err(e) if is_empty_answer(&e) => None,
                    Err(e) => return Err(e),
                };
                let Some(ip) = ip else {
                    tracing::debug!(%target, "SRV target has no address; skipped");
                    continue;
                };
                let host = target.to_utf8();
                let mut b = backend(entry, url_of(ip, port));
                b.name = Some(format!("{}:{port}", host.trim_end_matches('.')));
                out.push(b);
            }
            out.sort_by(|a, b| a.name.cmp(&b.name));
            out.dedup_by(|a, b| a.name == b.name);
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
    use std::sync::Mutex;

    use hickory_proto::op::{Message, MessageType, ResponseCode};
    use hickory_proto::rr::rdata::{A, AAAA, SRV};
    use hickory_proto::rr::{Name, RData, Record, RecordType};
    use tokio::net::UdpSocket;

    type Zone = Arc<Mutex<HashMap<(String, RecordType), Vec<RData>>>>;

    /// A tiny authoritative responder on a loopback UDP port: answers from `zone`, NXDOMAIN
    /// for names it does not hold at all.
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

    fn settings(ns: SocketAddr) -> DiscoverySettings {
        DiscoverySettings {
            nameserver: Some(ns),
            min_ttl_ms: 0,
            timeout_ms: 1_000,
            ..DiscoverySettings::default()
        }
    }

    fn entry(name: &str, record: DnsRecord, port: Option<u16>) -> DnsBackends {
        DnsBackends {
            name: name.to_owned(),
            record,
            port,
            region: "eu".to_owned(),
            models: vec!["m".to_owned()],
            max_inflight: 7,
            api_key: None,
            prefix_capacity_blocks: None,
        }
    }

    #[tokio::test]
    async fn a_and_aaaa_records_become_backends_on_the_configured_port() {
        let zone: Zone = Arc::default();
        zone.lock().expect("zone").insert(
            ("vllm.test.".into(), RecordType::A),
            vec![
                RData::A(A(Ipv4Addr::new(127, 0, 0, 3))),
                RData::A(A(Ipv4Addr::new(127, 0, 0, 2))),
            ],
        );
        zone.lock().expect("zone").insert(
            ("vllm.test.".into(), RecordType::AAAA),
            vec![RData::AAAA(AAAA(Ipv6Addr::LOCALHOST))],
        );
        let ns = dns_server(zone.clone()).await;
        let r = resolver(&settings(ns)).expect("resolver");
        let e = entry("vllm.test.", DnsRecord::A, Some(8000));
        let found = resolve(&r, &e).await.expect("resolved");
        let urls: Vec<&str> = found.iter().map(|b| b.url.as_str()).collect();
        assert_eq!(
            urls,
            [
                "http://127.0.0.2:8000",
                "http://127.0.0.3:8000",
                "http://[::1]:8000"
            ]
        );
        assert_eq!(found[0].display_name(), "127.0.0.2:8000");
        assert_eq!(found[0].region, "eu");
        assert_eq!(found[0].max_inflight, 7);
        assert_eq!(found[0].models, ["m"]);
        // A name that does not exist is an empty set, not an error.
        let gone = entry("gone.test.", DnsRecord::A, Some(8000));
        assert!(resolve(&r, &gone).await.expect("answered").is_empty());
    }

    #[tokio::test]
    async fn srv_records_become_backends_named_by_target_and_port() {
        let zone: Zone = Arc::default();
        let target = |s: &str| Name::from_ascii(s).expect("name");
        {
            let mut z = zone.lock().expect("zone");
            z.insert(
                ("_http._tcp.sims.test.".into(), RecordType::SRV),
                vec![
                    RData::SRV(SRV::new(0, 1, 9001, target("b.sims.test."))),
                    RData::SRV(SRV::new(0, 1, 9000, target("a.sims.test."))),
                    RData::SRV(SRV::new(0, 1, 9002, target("nowhere.sims.test."))),
                ],
            );
            z.insert(
                ("a.sims.test.".into(), RecordType::A),
                vec![RData::A(A(Ipv4Addr::LOCALHOST))],
            );
            z.insert(
                ("b.sims.test.".into(), RecordType::A),
                vec![RData::A(A(Ipv4Addr::new(127, 0, 0, 9)))],
            );
        }
        let ns = dns_server(zone).await;
        let r = resolver(&settings(ns)).expect("resolver");
        let e = entry("_http._tcp.sims.test.", DnsRecord::Srv, None);
        let found = resolve(&r, &e).await.expect("resolved");
        let got: Vec<(String, &str)> = found
            .iter()
            .map(|b| (b.display_name(), b.url.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("a.sims.test:9000".to_owned(), "http://127.0.0.1:9000"),
                ("b.sims.test:9001".to_owned(), "http://127.0.0.9:9001"),
            ]
        );
    }

    #[tokio::test]
    async fn an_unreachable_nameserver_is_an_error_not_an_empty_set() {
        // A bound socket that never answers.
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let mut s = settings(silent.local_addr().expect("addr"));
        s.timeout_ms = 100;
        let r = resolver(&s).expect("resolver");
        let e = entry("vllm.test.", DnsRecord::A, Some(8000));
        assert!(resolve(&r, &e).await.is_err());
    }

    #[test]
    fn diff_removes_gone_and_moved_backends_and_adds_new_and_moved_ones() {
        let current: HashMap<String, String> = [
            ("a:1".to_owned(), "http://10.0.0.1:1".to_owned()),
            ("b:1".to_owned(), "http://10.0.0.2:1".to_owned()),
            ("c:1".to_owned(), "http://10.0.0.3:1".to_owned()),
        ]
        .into();
        let wanted = [
            ("a:1".to_owned(), "http://10.0.0.1:1".to_owned()),
            ("b:1".to_owned(), "http://10.0.0.9:1".to_owned()),
            ("d:1".to_owned(), "http://10.0.0.4:1".to_owned()),
        ];
        let (remove, add) = diff(&current, wanted.iter().map(|(n, u)| (n, u)));
        assert_eq!(remove, ["b:1", "c:1"]);
        assert_eq!(add, ["b:1", "d:1"]);
    }
}
