//! The benchmark's model: a few safetensors-like shards of seeded random bytes plus the small
//! files a real checkpoint carries, generated once and reused by later runs.
//!
//! Random data, not zeros: nothing on the path may get a free ride from compression or sparse
//! files. The generator is a splitmix64-seeded xoshiro256++ written out here (eight bytes per
//! step, several GB/s) so that generating 2 GB costs about as long as writing it, and the same
//! seed always gives the same bytes. A `.complete` file beside the directory records the
//! layout; a directory without it (an interrupted generation) is regenerated.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::BenchError;

/// Largest shard; a 2 GB model becomes four shards, as checkpoints on a hub usually are.
const SHARD_BYTES: u64 = 512 << 20;
/// The last shard is shorter by this much so that files do not end on a piece boundary.
const LAST_SHARD_SHORTER: u64 = 12_345;

/// One file of the generated model.
#[derive(Clone, Debug, Serialize)]
pub struct ModelFile {
    /// Path relative to the model directory.
    pub path: String,
    /// Bytes.
    pub size: u64,
}

/// A generated model on disk.
#[derive(Clone, Debug, Serialize)]
pub struct GeneratedModel {
    /// The directory.
    pub dir: PathBuf,
    /// Every file, shards first.
    pub files: Vec<ModelFile>,
    /// Bytes of all files.
    pub total_bytes: u64,
    /// Seconds spent generating it in this run (0 when reused).
    pub generate_secs: f64,
}

impl GeneratedModel {
    /// The largest file (the first shard).
    pub fn largest(&self) -> &ModelFile {
        self.files
            .iter()
            .max_by_key(|f| f.size)
            .expect("invariant: a generated model has at least one shard")
    }
}

/// Shard data lengths (excluding headers) for about `total` bytes: equal shards of at most
/// [`SHARD_BYTES`], at least two, the last a little shorter.
pub fn shard_lengths(total: u64) -> Vec<u64> {
    let n = total.div_ceil(SHARD_BYTES).max(2);
    let each = total / n;
    let mut v = vec![each; n as usize];
    if let Some(last) = v.last_mut() {
        *last = last.saturating_sub(LAST_SHARD_SHORTER.min(*last / 2));
    }
    v
}

/// xoshiro256++ (Blackman and Vigna, 2018), seeded through splitmix64.
pub struct FastRng {
    s: [u64; 4],
}

impl FastRng {
    /// A generator whose whole output is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Fills `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> BenchError {
    move |source| BenchError::Io { context, source }
}

/// Writes one shard: 8-byte little-endian header length, a JSON header, `data_len` random
/// bytes.
fn write_shard(path: &Path, data_len: u64, rng: &mut FastRng) -> Result<u64, BenchError> {
    let header = format!(
        "{{\"__metadata__\":{{\"format\":\"pt\"}},\"weight\":{{\"dtype\":\"BF16\",\"shape\":[{}],\"data_offsets\":[0,{data_len}]}}}}",
        data_len / 2
    );
    let file =
        std::fs::File::create(path).map_err(io(format!("cannot create {}", path.display())))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let err = || format!("cannot write {}", path.display());
    w.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|()| w.write_all(header.as_bytes()))
        .map_err(io(err()))?;
    let mut buf = vec![0u8; 4 << 20];
    let mut left = data_len;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        rng.fill(&mut buf[..n]);
        w.write_all(&buf[..n]).map_err(io(err()))?;
        left -= n as u64;
    }
    w.flush().map_err(io(err()))?;
    Ok(8 + header.len() as u64 + data_len)
}

/// The layout a directory must have to be reused, as written into its `.complete` file.
fn spec(total: u64, seed: u64) -> String {
    format!("tokenway bench weights model v1 size={total} seed={seed}\n")
}

/// The model of about `total` bytes for `seed` under `data_dir`: reused when a complete one
/// is there, generated otherwise.
pub fn ensure(data_dir: &Path, total: u64, seed: u64) -> Result<GeneratedModel, BenchError> {
    let name = format!("model-{total}-seed{seed}");
    let dir = data_dir.join(&name);
    let marker = data_dir.join(format!("{name}.complete"));
    let lengths = shard_lengths(total);
    let n = lengths.len();
    let shard_name = |i: usize| format!("model-{:05}-of-{n:05}.safetensors", i + 1);
    let small: [(&str, &[u8]); 2] = [
        (
            "config.json",
            b"{\"architectures\":[\"BenchForCausalLM\"],\"hidden_size\":4096}\n",
        ),
        (
            "tokenizer/tokenizer.json",
            b"{\"version\":\"1.0\",\"vocab\":{}}\n",
        ),
    ];
    let mut generate_secs = 0.0;
    let reuse = std::fs::read_to_string(&marker).is_ok_and(|s| s == spec(total, seed));
    if !reuse {
        let t = std::time::Instant::now();
        let _ = std::fs::remove_file(&marker);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tokenizer"))
            .map_err(io(format!("cannot create {}", dir.display())))?;
        let mut rng = FastRng::new(seed);
        for (i, len) in lengths.iter().enumerate() {
            write_shard(&dir.join(shard_name(i)), *len, &mut rng)?;
        }
        for (path, bytes) in small {
            let p = dir.join(path);
            std::fs::write(&p, bytes).map_err(io(format!("cannot write {}", p.display())))?;
        }
        std::fs::write(&marker, spec(total, seed))
            .map_err(io(format!("cannot write {}", marker.display())))?;
        generate_secs = t.elapsed().as_secs_f64();
    }
    let mut files = Vec::new();
    let names = (0..n)
        .map(shard_name)
        .chain(small.iter().map(|(p, _)| (*p).to_owned()));
    for path in names {
        let p = dir.join(&path);
        let size = std::fs::metadata(&p)
            .map_err(io(format!("cannot stat {}", p.display())))?
            .len();
        files.push(ModelFile { path, size });
    }
    Ok(GeneratedModel {
        dir,
        total_bytes: files.iter().map(|f| f.size).sum(),
        files,
        generate_secs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_gigabytes_become_four_shards_of_at_most_512_mib() {
        let v = shard_lengths(2 << 30);
        assert_eq!(v.len(), 4);
        assert!(v.iter().all(|l| *l <= SHARD_BYTES));
        assert_eq!(v[0] - v[3], LAST_SHARD_SHORTER);
        assert_eq!(shard_lengths(64 << 20).len(), 2);
    }

    #[test]
    fn the_same_seed_gives_the_same_bytes_and_every_byte_is_filled() {
        let (mut a, mut b) = (vec![0u8; 1001], vec![0u8; 1001]);
        FastRng::new(7).fill(&mut a);
        FastRng::new(7).fill(&mut b);
        assert_eq!(a, b);
        let mut c = vec![0u8; 1001];
        FastRng::new(8).fill(&mut c);
        assert_ne!(a, c);
        // No long run of zeros at the tail (the remainder is filled too).
        assert!(a[993..].iter().any(|x| *x != 0));
    }

    #[test]
    fn a_complete_model_is_reused_and_an_interrupted_one_regenerated() {
        let dir = std::env::temp_dir().join(format!("tokenway-bench-model-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let m = ensure(&dir, 1 << 20, 3).expect("generated");
        assert_eq!(m.files.len(), 4);
        assert!(m.generate_secs > 0.0);
        let again = ensure(&dir, 1 << 20, 3).expect("reused");
        assert_eq!(again.generate_secs, 0.0);
        assert_eq!(again.total_bytes, m.total_bytes);
        std::fs::remove_file(dir.join("model-1048576-seed3.complete")).expect("marker");
        let regen = ensure(&dir, 1 << 20, 3).expect("regenerated");
        assert!(regen.generate_secs > 0.0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
