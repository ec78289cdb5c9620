//! Namespaces, links, addresses and routes, through the `ip` command (iproute2): the robust,
//! well-understood way, and exactly what a user would type to inspect or repair by hand.

use std::io::Write as _;
use std::process::{Command, Stdio};

use crate::{sys, NetlabError};

/// Runs `ip ARGS...` and returns its stdout.
pub fn ip(args: &[&str]) -> Result<String, NetlabError> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| NetlabError::Command {
            command: format!("ip {}", args.join(" ")),
            stderr: format!("cannot start `ip` (is iproute2 installed?): {e}"),
        })?;
    if !out.status.success() {
        return Err(NetlabError::Command {
            command: format!("ip {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs several `ip` commands inside namespace `ns` in one process (`ip -n NS -batch -`).
pub fn ip_batch(ns: &str, commands: &[String]) -> Result<(), NetlabError> {
    let command = format!("ip -n {ns} -batch - <<{:?}", commands);
    let mut child = Command::new("ip")
        .args(["-n", ns, "-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| NetlabError::Command {
            command: command.clone(),
            stderr: format!("cannot start `ip`: {e}"),
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        let text = commands.join("\n") + "\n";
        stdin
            .write_all(text.as_bytes())
            .map_err(|e| NetlabError::io("writing to `ip -batch`", e))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| NetlabError::io("waiting for `ip -batch`", e))?;
    if !out.status.success() {
        return Err(NetlabError::Command {
            command,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// Network namespaces whose name starts with `{prefix}-`.
pub fn namespaces_with_prefix(prefix: &str) -> Vec<String> {
    let want = format!("{prefix}-");
    // `ip netns list` prints "name" or "name (id: N)".
    ip(&["netns", "list"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&want))
        .map(str::to_string)
        .collect()
}

/// Links in the root namespace whose name starts with `{prefix}-`.
pub fn links_with_prefix(prefix: &str) -> Vec<String> {
    let want = format!("{prefix}-");
    // `ip -o link show` prints "N: name: <...>" or "N: name@peer: <...>".
    ip(&["-o", "link", "show"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(':').nth(1))
        .map(|n| n.trim().split('@').next().unwrap_or("").to_string())
        .filter(|n| n.starts_with(&want))
        .collect()
}

/// Deletes every namespace and root-namespace link with the prefix. Returns what was removed.
pub fn remove_with_prefix(prefix: &str) -> (Vec<String>, Vec<String>) {
    let namespaces = namespaces_with_prefix(prefix);
    for ns in &namespaces {
        if let Err(e) = ip(&["netns", "delete", ns]) {
            tracing::warn!("{e}");
        }
    }
    let links = links_with_prefix(prefix);
    for link in &links {
        if let Err(e) = ip(&["link", "delete", link]) {
            tracing::warn!("{e}");
        }
    }
    (namespaces, links)
}

/// Runs `f` on a fresh thread inside namespace `ns` and returns its result. Sockets created
/// by `f` stay in that namespace and may be used from any thread afterwards.
pub fn run_in_namespace<R: Send>(ns: &str, f: impl FnOnce() -> R + Send) -> Result<R, NetlabError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            sys::enter_namespace(ns)
                .map_err(|e| NetlabError::io(format!("cannot enter namespace {ns}"), e))?;
            Ok(f())
        })
        .join()
        .map_err(|_| NetlabError::Config(format!("a task inside namespace {ns} panicked")))?
    })
}
