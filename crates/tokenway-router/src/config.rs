//! All router settings in one place: [`RouterConfig`].
//!
//! Each concern keeps its own struct next to its logic ([`HealthConfig`], [`OutlierConfig`],
//! [`CostConfig`], [`AffinityConfig`], [`HedgeConfig`]); this module only bundles them and
//! validates the bundle. Serde mapping lives in the gateway's configuration, which owns the
//! key names users write.

use std::time::Duration;

use crate::affinity::AffinityConfig;
use crate::cost::CostConfig;
use crate::error::InvalidSetting;
use crate::health::{HealthConfig, OutlierConfig};
use crate::hedge::HedgeConfig;
use crate::router::DEFAULT_TTFT_ESTIMATE;

/// Blocks each backend's prefix index holds by default: 16 384 blocks of 256 bytes (~64
/// tokens) is ~1 M tokens, the order of one GPU's KV cache, in under 1 MiB of router memory.
pub const DEFAULT_PREFIX_CAPACITY_BLOCKS: usize = 16_384;

/// Every router setting.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterConfig {
    /// Probes, passive ejection and re-admission.
    pub health: HealthConfig,
    /// Stalls, TTFT outliers and half-open trials.
    pub outlier: OutlierConfig,
    /// The `cost` policy's model.
    pub cost: CostConfig,
    /// Session placement.
    pub affinity: AffinityConfig,
    /// Hedging.
    pub hedge: HedgeConfig,
    /// Entry bound of each backend's prefix index (0 disables prefix tracking).
    pub prefix_capacity_blocks: usize,
    /// TTFT assumed by `p2c_ewma` for a backend without samples.
    pub default_ttft: Duration,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            health: HealthConfig::default(),
            outlier: OutlierConfig::default(),
            cost: CostConfig::default(),
            affinity: AffinityConfig::default(),
            hedge: HedgeConfig::default(),
            prefix_capacity_blocks: DEFAULT_PREFIX_CAPACITY_BLOCKS,
            default_ttft: DEFAULT_TTFT_ESTIMATE,
        }
    }
}

impl RouterConfig {
    /// Defaults with the given health thresholds (what [`Router::new`](crate::Router::new)
    /// uses).
    pub fn with_health(health: HealthConfig) -> Self {
        Self {
            health,
            ..Self::default()
        }
    }

    /// Check every range.
    ///
    /// # Errors
    ///
    /// [`InvalidSetting`] naming the first key out of range.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        self.outlier.validate()?;
        self.cost.validate()?;
        self.affinity.validate()?;
        self.hedge.validate()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_errors_name_the_key_and_range() {
        assert_eq!(RouterConfig::default().validate(), Ok(()));
        let mut c = RouterConfig::default();
        c.affinity.epsilon = 0.0;
        let msg = c.validate().expect_err("epsilon 0").to_string();
        assert_eq!(
            msg,
            "routing setting `affinity.epsilon` must be a number > 0 (0.25 is typical) (got 0)"
        );
    }
}
