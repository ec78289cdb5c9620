//! The one error type of the crate.

/// Everything that can go wrong in the lab, with a message a user can act on.
#[derive(Debug, thiserror::Error)]
pub enum NetlabError {
    /// A profile or lab configuration is invalid.
    #[error("invalid netlab config: {0}")]
    Config(String),
    /// A profile could not be found or parsed.
    #[error("profile {name}: {message}")]
    Profile {
        /// Profile name or file.
        name: String,
        /// What was wrong.
        message: String,
    },
    /// An `ip` command failed.
    #[error("`{command}` failed: {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// What it printed on stderr (or how it failed to start).
        stderr: String,
    },
    /// A system call or file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN).
    #[error("netlab needs root (network namespaces and TUN devices); run it with sudo")]
    NotRoot,
    /// A lab with this prefix already exists.
    #[error("a netlab named {0:?} is already up; run `tokenway netlab down --name {0}` first")]
    AlreadyUp(String),
}

impl NetlabError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        NetlabError::Io {
            what: what.into(),
            source,
        }
    }
}
