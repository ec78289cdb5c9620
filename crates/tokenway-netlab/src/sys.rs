//! The few raw system calls the lab needs: TUN devices, entering a network namespace,
//! precise waiting, scheduling. Every `unsafe` block of the crate is here.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// A TUN device (IFF_TUN | IFF_NO_PI: raw IP packets, no header), non-blocking.
/// The device disappears when this is dropped (it is not persistent).
#[derive(Debug)]
pub struct Tun {
    fd: OwnedFd,
    name: String,
}

/// `struct ifreq` as TUNSETIFF reads it: a 16-byte name, then the flags (a short) in a
/// 24-byte union.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

impl Tun {
    /// Creates the TUN device `name` in the calling thread's network namespace.
    pub fn create(name: &str) -> io::Result<Tun> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("interface name {name:?} must be 1 to 15 bytes"),
            ));
        }
        // SAFETY: plain open(2) of a NUL-terminated path; the fd is owned below.
        let fd = unsafe {
            libc::open(
                c"/dev/net/tun".as_ptr(),
                libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads and writes a `struct ifreq`, which IfReq lays out exactly.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut req) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Tun {
            fd,
            name: name.to_string(),
        })
    }

    /// The interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads one packet; `Ok(None)` when none is waiting.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        // SAFETY: buf is valid for writes of buf.len() bytes.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                _ => Err(e),
            };
        }
        Ok(Some(n as usize))
    }

    /// Writes one packet into the device (the kernel receives it as if from the wire).
    pub fn write(&self, packet: &[u8]) -> io::Result<()> {
        // SAFETY: packet is valid for reads of packet.len() bytes.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), packet.as_ptr().cast(), packet.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Moves the calling thread into the network namespace `/run/netns/{name}`.
pub fn enter_namespace(name: &str) -> io::Result<()> {
    let file = File::open(format!("/run/netns/{name}"))?;
    // SAFETY: setns(2) on an fd we hold open; affects only the calling thread.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Waits until one of `fds` is readable or `timeout` passes; marks the readable ones in
/// `ready`. Nanosecond timeout (ppoll), unlike poll's milliseconds.
pub fn wait_readable(fds: &[RawFd], ready: &mut [bool], timeout: Duration) -> io::Result<()> {
    let mut pfds: [libc::pollfd; 16] = [libc::pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    }; 16];
    let n = fds.len().min(16);
    for (p, fd) in pfds.iter_mut().zip(fds) {
        p.fd = *fd;
        p.events = libc::POLLIN;
    }
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: pfds holds n initialised entries; ts is a valid timespec; no signal mask.
    let rc = unsafe { libc::ppoll(pfds.as_mut_ptr(), n as libc::nfds_t, &ts, std::ptr::null()) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    for (r, p) in ready.iter_mut().zip(&pfds[..n]) {
        *r = rc > 0 && p.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0;
    }
    Ok(())
}

/// Makes the calling thread's timers exact (1 ns slack instead of the default 50 µs) and,
/// with `realtime_priority`, gives it that SCHED_FIFO priority so a busy machine does not
/// delay it. Returns whether real-time priority was granted.
pub fn tune_current_thread(realtime_priority: Option<i32>) -> bool {
    // SAFETY: prctl(PR_SET_TIMERSLACK) takes an integer and affects only this thread.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
    let Some(priority) = realtime_priority else {
        return false;
    };
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: pid 0 is the calling thread; param is a valid sched_param.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) == 0 }
}

/// The effective user id.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Sends `signal` to process `pid`; false if it does not exist.
pub fn kill(pid: i32, signal: libc::c_int) -> bool {
    // SAFETY: kill(2) with a concrete pid (> 0 checked) never touches our memory.
    pid > 0 && unsafe { libc::kill(pid, signal) == 0 }
}

/// Sets a socket's send and receive buffers to `bytes`, beyond the sysctl limits (root).
pub fn set_socket_buffers(fd: RawFd, bytes: i32) {
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_SNDBUFFORCE] {
        // SAFETY: setsockopt with a pointer to an int of the size passed.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&bytes as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            );
        }
    }
}
