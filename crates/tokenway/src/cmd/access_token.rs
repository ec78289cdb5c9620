//! `--token`: the weights tier's access token, shared by `mirror`, `pull` and `preheat` (see
//! `tokenway_mirror::auth` and `docs/weights.md`).

use tokenway_mirror::auth::AccessToken;

/// The `--token` flag (or `TOKENWAY_WEIGHTS_TOKEN`, preferred: flags show in the process list).
#[derive(clap::Args, Clone)]
pub struct TokenArg {
    /// Access token of the weights tier: a mirror or `--serve` peer given one answers 401
    /// without it; pullers and preheat send it. 16 to 512 visible ASCII characters.
    #[arg(
        long = "token",
        value_name = "TOKEN",
        env = "TOKENWAY_WEIGHTS_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
}

impl TokenArg {
    /// The checked token, if one was given.
    pub fn get(&self) -> anyhow::Result<Option<AccessToken>> {
        Ok(AccessToken::from_arg(self.token.as_deref())?)
    }
}
