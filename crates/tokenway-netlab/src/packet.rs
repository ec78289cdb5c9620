//! Just enough IPv4/IPv6 parsing to route a packet and to decide UDP blocking: destination
//! address, transport protocol and UDP ports. Sans-IO; never panics on short or odd packets.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// IANA protocol numbers (RFC 790 / IANA "Assigned Internet Protocol Numbers").
const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;

/// The transport of a packet, as far as the emulator cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// UDP; ports are `None` for a non-first fragment or a truncated header.
    Udp(Option<(u16, u16)>),
    /// TCP (always passes UDP blocking).
    Tcp,
    /// Anything else (ICMP, unknown, unparsable).
    Other,
}

/// Destination and transport of one IP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketInfo {
    /// Destination address, `None` if the packet is not IPv4/IPv6 or is truncated.
    pub dst: Option<IpAddr>,
    /// Transport protocol and UDP ports.
    pub transport: Transport,
}

/// Destination IPv4 address of a packet, the only thing the forwarding path needs.
pub fn ipv4_destination(packet: &[u8]) -> Option<Ipv4Addr> {
    if packet.len() >= 20 && packet[0] >> 4 == 4 {
        Some(Ipv4Addr::new(
            packet[16], packet[17], packet[18], packet[19],
        ))
    } else {
        None
    }
}

/// Parses the IP header (and IPv6 extension headers) of `packet`.
pub fn classify(packet: &[u8]) -> PacketInfo {
    let unknown = PacketInfo {
        dst: None,
        transport: Transport::Other,
    };
    match packet.first().map(|b| b >> 4) {
        Some(4) => {
            if packet.len() < 20 {
                return unknown;
            }
            let ihl = usize::from(packet[0] & 0x0f) * 4;
            let proto = packet[9];
            let dst = Ipv4Addr::new(packet[16], packet[17], packet[18], packet[19]);
            let fragment_offset = u16::from_be_bytes([packet[6] & 0x1f, packet[7]]);
            let l4 = if fragment_offset == 0 && ihl >= 20 {
                packet.get(ihl..)
            } else {
                None
            };
            PacketInfo {
                dst: Some(IpAddr::V4(dst)),
                transport: transport(proto, l4),
            }
        }
        Some(6) => {
            if packet.len() < 40 {
                return unknown;
            }
            let mut dst = [0u8; 16];
            dst.copy_from_slice(&packet[24..40]);
            let mut next = packet[6];
            let mut offset = 40usize;
            let mut first_fragment = true;
            // Walk the extension headers (RFC 8200 section 4) up to the transport header.
            loop {
                match next {
                    0 | 43 | 60 => {
                        let Some(hdr) = packet.get(offset..offset + 2) else {
                            break;
                        };
                        next = hdr[0];
                        offset += (usize::from(hdr[1]) + 1) * 8;
                    }
                    44 => {
                        let Some(hdr) = packet.get(offset..offset + 8) else {
                            break;
                        };
                        next = hdr[0];
                        first_fragment = u16::from_be_bytes([hdr[2], hdr[3]]) >> 3 == 0;
                        offset += 8;
                    }
                    _ => break,
                }
            }
            let l4 = if first_fragment {
                packet.get(offset..)
            } else {
                None
            };
            PacketInfo {
                dst: Some(IpAddr::V6(Ipv6Addr::from(dst))),
                transport: transport(next, l4),
            }
        }
        _ => unknown,
    }
}

fn transport(proto: u8, l4: Option<&[u8]>) -> Transport {
    match proto {
        PROTO_TCP => Transport::Tcp,
        PROTO_UDP => Transport::Udp(l4.and_then(|h| {
            let h = h.get(..4)?;
            Some((
                u16::from_be_bytes([h[0], h[1]]),
                u16::from_be_bytes([h[2], h[3]]),
            ))
        })),
        _ => Transport::Other,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A minimal IPv4 packet with the given protocol and (for UDP/TCP) ports.
    pub(crate) fn ipv4(proto: u8, src_port: u16, dst_port: u16, len: usize) -> Vec<u8> {
        let mut p = vec![0u8; len.max(28)];
        p[0] = 0x45;
        p[9] = proto;
        p[12..16].copy_from_slice(&[198, 18, 0, 1]);
        p[16..20].copy_from_slice(&[198, 18, 0, 2]);
        p[20..22].copy_from_slice(&src_port.to_be_bytes());
        p[22..24].copy_from_slice(&dst_port.to_be_bytes());
        p
    }

    #[test]
    fn ipv4_udp_ports_and_destination_are_parsed() {
        let info = classify(&ipv4(17, 1234, 443, 100));
        assert_eq!(info.dst, Some(IpAddr::V4(Ipv4Addr::new(198, 18, 0, 2))));
        assert_eq!(info.transport, Transport::Udp(Some((1234, 443))));
        assert_eq!(classify(&ipv4(6, 1, 2, 60)).transport, Transport::Tcp);
        assert_eq!(classify(&ipv4(1, 1, 2, 60)).transport, Transport::Other);
    }

    #[test]
    fn ipv4_non_first_fragment_has_no_ports() {
        let mut p = ipv4(17, 1, 2, 100);
        p[7] = 10;
        assert_eq!(classify(&p).transport, Transport::Udp(None));
    }

    #[test]
    fn ipv6_udp_after_a_hop_by_hop_header_is_found() {
        let mut p = vec![0u8; 40 + 8 + 8];
        p[0] = 0x60;
        p[6] = 0; // hop-by-hop
        p[40] = 17; // next: UDP
        p[41] = 0; // 8 bytes
        p[48..50].copy_from_slice(&5000u16.to_be_bytes());
        p[50..52].copy_from_slice(&53u16.to_be_bytes());
        assert_eq!(classify(&p).transport, Transport::Udp(Some((5000, 53))));
    }

    #[test]
    fn garbage_is_other_and_never_panics() {
        for len in 0..64 {
            let p = vec![0x4f; len];
            let _ = classify(&p);
            let p = vec![0x60; len];
            let _ = classify(&p);
        }
        assert_eq!(classify(&[]).dst, None);
    }
}
