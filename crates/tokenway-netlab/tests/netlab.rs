//! Integration tests of the lab: real namespaces, TUN devices and the emulator thread.
//! They need root (CI runs as root); otherwise each prints "SKIP: needs root" and passes.
//! Each test uses its own name prefix, and the `Lab` guard tears everything down even when an
//! assertion fails. The tests take turns (a static lock): timing assertions on a 2-core
//! machine should not measure the other tests' traffic.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokenway_netlab::model::{Conditions, DropReason};
use tokenway_netlab::{Lab, LabConfig, Profile, CLIENT, SERVER};

static SERIAL: Mutex<()> = Mutex::new(());

/// Takes the turn lock, or returns `None` (after printing SKIP) without root.
fn root() -> Option<MutexGuard<'static, ()>> {
    if !tokenway_netlab::is_root() {
        eprintln!("SKIP: needs root");
        return None;
    }
    Some(
        SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()),
    )
}

/// `recv_from`, retried when a signal interrupts it.
fn recv_from(socket: &UdpSocket, buf: &mut [u8]) -> std::io::Result<(usize, SocketAddr)> {
    loop {
        match socket.recv_from(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

fn lab(prefix: &str, profile: &Profile) -> Lab {
    // Leftovers of an earlier aborted run of this very test.
    let _ = tokenway_netlab::down(prefix);
    Lab::up(LabConfig::from_profile(prefix, profile, 7)).expect("lab comes up")
}

fn symmetric(conditions: Conditions) -> Profile {
    Profile::symmetric("test", conditions)
}

fn udp_pair(lab: &Lab, port: u16) -> (UdpSocket, UdpSocket, SocketAddr) {
    let server = SocketAddr::new(lab.address(SERVER).expect("server").into(), port);
    let client = SocketAddr::new(lab.address(CLIENT).expect("client").into(), 0);
    let rx = lab
        .run_in(SERVER, || UdpSocket::bind(server))
        .expect("enter server ns")
        .expect("bind server");
    let tx = lab
        .run_in(CLIENT, || UdpSocket::bind(client))
        .expect("enter client ns")
        .expect("bind client");
    tokenway_netlab::set_socket_buffers(std::os::fd::AsRawFd::as_raw_fd(&rx), 8 << 20);
    (tx, rx, server)
}

#[test]
fn a_40ms_rtt_link_measures_40_ms() {
    let Some(_turn) = root() else {
        return;
    };
    let lab = lab(
        "twt40",
        &symmetric(Conditions {
            delay: Duration::from_millis(20),
            ..Default::default()
        }),
    );
    let (tx, rx, server) = udp_pair(&lab, 7000);
    let echo = std::thread::spawn(move || {
        rx.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        let mut buf = [0u8; 64];
        while let Ok((n, from)) = recv_from(&rx, &mut buf) {
            if rx.send_to(&buf[..n], from).is_err() || &buf[..n] == b"stop" {
                break;
            }
        }
    });
    tx.set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let mut rtts = Vec::new();
    for i in 0u32..20 {
        let start = Instant::now();
        tx.send_to(&i.to_be_bytes(), server).expect("send");
        let mut buf = [0u8; 64];
        let (n, _) = recv_from(&tx, &mut buf).expect("echo within 500 ms");
        assert_eq!(&buf[..n], &i.to_be_bytes());
        rtts.push(start.elapsed().as_secs_f64() * 1000.0);
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = tx.send_to(b"stop", server);
    let _ = echo.join();
    rtts.sort_by(f64::total_cmp);
    let median = rtts[rtts.len() / 2];
    assert!(
        (median - 40.0).abs() <= 2.0,
        "median RTT {median} ms: {rtts:?}"
    );
    assert!(rtts[0] >= 39.9, "an RTT below the link delay: {rtts:?}");
    lab.down().expect("clean down");
}

#[test]
fn a_10_percent_loss_link_drops_10_percent_of_a_udp_burst() {
    let Some(_turn) = root() else {
        return;
    };
    let lab = lab(
        "twtloss",
        &symmetric(Conditions {
            delay: Duration::from_millis(1),
            loss: 0.10,
            ..Default::default()
        }),
    );
    let (tx, rx, server) = udp_pair(&lab, 7001);
    rx.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let n = 2000u32;
    for i in 0..n {
        tx.send_to(&i.to_be_bytes(), server).expect("send");
        if i % 100 == 99 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let mut received = 0u32;
    let mut buf = [0u8; 64];
    while recv_from(&rx, &mut buf).is_ok() {
        received += 1;
    }
    let loss = 1.0 - f64::from(received) / f64::from(n);
    assert!((0.08..=0.12).contains(&loss), "loss {loss}");
    let stats = lab.stats();
    let up = &stats.directions[0];
    assert_eq!(up.received, u64::from(n), "every packet reached the model");
    assert_eq!(
        up.dropped(DropReason::RandomLoss),
        u64::from(n - received),
        "drops are all random loss"
    );
    lab.down().expect("clean down");
}

#[test]
fn udp_blocked_passes_tcp_and_drops_udp() {
    let Some(_turn) = root() else {
        return;
    };
    let lab = lab(
        "twtudpb",
        &Profile::builtin("udp-blocked").expect("builtin"),
    );
    let server_ip = lab.address(SERVER).expect("server");
    let addr = SocketAddr::new(server_ip.into(), 7443);
    let listener = lab
        .run_in(SERVER, || TcpListener::bind(addr))
        .expect("enter server ns")
        .expect("listen");
    let accept = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).expect("read");
        s.write_all(&buf).expect("write back");
    });
    let mut stream = lab
        .run_in(CLIENT, || {
            TcpStream::connect_timeout(&addr, Duration::from_secs(3))
        })
        .expect("enter client ns")
        .expect("TCP connects through the udp-blocked link");
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    stream.write_all(b"hello").expect("send");
    let mut back = [0u8; 5];
    stream.read_exact(&mut back).expect("echo");
    assert_eq!(&back, b"hello");
    accept.join().expect("server thread");

    let (tx, rx, server) = udp_pair(&lab, 7444);
    rx.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    for _ in 0..50 {
        tx.send_to(b"udp", server).expect("send");
    }
    let mut buf = [0u8; 16];
    assert!(
        recv_from(&rx, &mut buf).is_err(),
        "a UDP packet got through"
    );
    let stats = lab.stats();
    assert_eq!(stats.directions[0].dropped(DropReason::UdpBlocked), 50);
    lab.down().expect("clean down");
}

#[test]
fn down_leaves_no_namespace_or_device_behind() {
    let Some(_turn) = root() else {
        return;
    };
    let prefix = "twtdown";
    let lab = lab(prefix, &Profile::builtin("4g").expect("builtin"));
    let (ns, _) = tokenway_netlab::leftovers(prefix);
    assert_eq!(ns.len(), 2, "both namespaces exist while up: {ns:?}");
    let devices =
        tokenway_netlab::netns::ip(&["-n", &lab.namespace(CLIENT), "-o", "link"]).expect("ip link");
    assert!(devices.contains("twtdown-client"), "{devices}");
    lab.down().expect("clean down");
    assert_eq!(
        tokenway_netlab::leftovers(prefix),
        (vec![], vec![]),
        "after down"
    );
    let all_links = tokenway_netlab::netns::ip(&["-o", "link"]).expect("ip link");
    assert!(!all_links.contains(prefix), "{all_links}");

    // After a crash (namespaces left, no emulator), `down` by name removes them.
    tokenway_netlab::netns::ip(&["netns", "add", "twtdown-client"]).expect("netns add");
    let report = tokenway_netlab::down(prefix).expect("down after crash");
    assert_eq!(report.namespaces, vec!["twtdown-client".to_string()]);
    assert_eq!(tokenway_netlab::leftovers(prefix), (vec![], vec![]));
}

#[test]
fn handover_moves_the_client_address_and_both_addresses_are_routed() {
    let Some(_turn) = root() else {
        return;
    };
    let profile = Profile::from_toml_str(
        "quick-handover",
        r#"
        description = "handover, fast"
        [conditions]
        delay_ms = 2.0
        [[blackout]]
        start_ms = 250.0
        duration_ms = 100.0
        [address_change]
        host = "client"
        addresses = ["198.18.0.1", "198.18.0.5"]
        first_ms = 300.0
        every_ms = 60000.0
        "#,
    )
    .expect("valid profile");
    let lab = lab("twtho", &profile);
    let ns = lab.namespace(CLIENT);
    let addrs = || tokenway_netlab::netns::ip(&["-n", &ns, "-4", "-o", "addr"]).expect("ip addr");
    assert!(addrs().contains("198.18.0.1/32"), "{}", addrs());
    std::thread::sleep(Duration::from_millis(600));
    let now = addrs();
    assert!(
        now.contains("198.18.0.5/32") && !now.contains("198.18.0.1/32"),
        "{now}"
    );

    // The new address reaches the server and gets answers back.
    let server = SocketAddr::new(lab.address(SERVER).expect("server").into(), 7500);
    let rx = lab
        .run_in(SERVER, || UdpSocket::bind(server))
        .expect("enter server ns")
        .expect("bind server");
    let tx = lab
        .run_in(CLIENT, || UdpSocket::bind("198.18.0.5:0"))
        .expect("enter client ns")
        .expect("bind the new address");
    tx.set_read_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    rx.set_read_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    tx.send_to(b"ping", server).expect("send");
    let mut buf = [0u8; 16];
    let (n, from) = recv_from(&rx, &mut buf).expect("server hears the new address");
    assert_eq!(from.ip().to_string(), "198.18.0.5");
    rx.send_to(&buf[..n], from).expect("reply");
    let (n, _) = recv_from(&tx, &mut buf).expect("reply reaches the new address");
    assert_eq!(&buf[..n], b"ping");
    lab.down().expect("clean down");
}
