//! The disk tier's file format.
//!
//! One file per cache entry, `<len>-<token hash>.kv`, in a folder per model identity
//! (`<dir>/<identity hash>/`), so caches of different models or quantizations never meet:
//!
//! ```text
//! magic "CAPYKV\r\n" (8 bytes) | u32 format version | u32 header length | header (JSON)
//! | u32 CRC-32 of the header | tokens (u32 LE × header.tokens) | state (header.state_bytes)
//! ```
//!
//! The JSON header names the model id, the weights' format/quantization, the session, and the
//! CRC-32 of the token and state sections. Files are written to a `.tmp` name, fsynced and
//! renamed, so a crash leaves either the old file or the whole new one. Anything that does not
//! check out (magic, version, identity, lengths, either checksum) is reported, deleted and
//! never used.

use super::state::{HostPart, HostState};
use anyhow::{bail, Context, Result};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 8] = b"CAPYKV\r\n";
/// Bumped whenever the layout of the header or the state section changes.
pub const FORMAT_VERSION: u32 = 1;
pub const EXTENSION: &str = "kv";

/// What a disk entry must match to be used.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheIdentity {
    /// The model: its name and shape (anything that changes the state's meaning).
    pub model_id: String,
    /// Weights' format and quantization, and the backend's numeric mode.
    pub format: String,
}

impl CacheIdentity {
    /// The folder name of this identity inside the disk cache folder.
    pub fn folder_name(&self) -> String {
        let h = crc32fast::hash(format!("{}\0{}", self.model_id, self.format).as_bytes());
        let safe: String = self
            .model_id
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .take(40)
            .collect();
        format!("{safe}-{h:08x}")
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Header {
    pub model_id: String,
    pub format: String,
    pub session: String,
    pub tokens: usize,
    pub tokens_crc32: u32,
    pub state_bytes: usize,
    pub state_crc32: u32,
    pub created_unix: f64,
}

/// An entry found on disk: its header and tokens (the state is read when used).
pub struct Found {
    pub path: PathBuf,
    pub header: Header,
    pub tokens: Vec<u32>,
    pub file_bytes: u64,
}

pub fn file_name(tokens: &[u32]) -> String {
    format!(
        "{:08}-{:016x}.{EXTENSION}",
        tokens.len(),
        super::tokens_hash(tokens)
    )
}

fn u32s_to_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_to_u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The state section: `u64 len | u32 tensors | (u32 rows, u32 cols, f32 × rows·cols)* | u32
/// id lists | (u32 n, u32 × n)*`, little-endian.
pub fn encode_state(s: &HostState) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.bytes() + 16 + 8 * (s.tensors.len() + s.ids.len()));
    out.extend((s.len as u64).to_le_bytes());
    out.extend((s.tensors.len() as u32).to_le_bytes());
    for t in &s.tensors {
        out.extend((t.rows as u32).to_le_bytes());
        out.extend((t.cols as u32).to_le_bytes());
        for x in &t.data {
            out.extend(x.to_le_bytes());
        }
    }
    out.extend((s.ids.len() as u32).to_le_bytes());
    for ids in &s.ids {
        out.extend((ids.len() as u32).to_le_bytes());
        out.extend(u32s_to_bytes(ids));
    }
    out
}

pub fn decode_state(b: &[u8]) -> Result<HostState> {
    let mut pos = 0usize;
    let mut take = |n: usize| -> Result<&[u8]> {
        let end = pos
            .checked_add(n)
            .filter(|&e| e <= b.len())
            .with_context(|| {
                format!(
                    "the state section ends at byte {} but needs {n} more from {pos}",
                    b.len()
                )
            })?;
        let s = &b[pos..end];
        pos = end;
        Ok(s)
    };
    let u32_at = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize;
    let len = u64::from_le_bytes(take(8)?.try_into().unwrap()) as usize;
    let n_tensors = u32_at(take(4)?);
    let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16));
    for _ in 0..n_tensors {
        let rows = u32_at(take(4)?);
        let cols = u32_at(take(4)?);
        let n = rows
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(4))
            .context("tensor size overflows")?;
        let data = take(n)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        tensors.push(HostPart { rows, cols, data });
    }
    let n_ids = u32_at(take(4)?);
    let mut ids = Vec::with_capacity(n_ids.min(1 << 16));
    for _ in 0..n_ids {
        let n = u32_at(take(4)?);
        ids.push(bytes_to_u32s(take(n.checked_mul(4).context("overflow")?)?));
    }
    if pos != b.len() {
        bail!(
            "the state section has {} bytes after its end",
            b.len() - pos
        );
    }
    Ok(HostState { len, tensors, ids })
}

fn fsync_dir(dir: &Path) {
    // Makes the rename durable; not every platform can open a folder, which is fine.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Writes an entry atomically; returns its path and size.
pub fn write_entry(
    dir: &Path,
    identity: &CacheIdentity,
    session: &str,
    tokens: &[u32],
    state: &HostState,
) -> Result<(PathBuf, u64)> {
    fs::create_dir_all(dir)
        .with_context(|| format!("creating the disk cache folder {}", dir.display()))?;
    let tok = u32s_to_bytes(tokens);
    let st = encode_state(state);
    let header = Header {
        model_id: identity.model_id.clone(),
        format: identity.format.clone(),
        session: session.to_string(),
        tokens: tokens.len(),
        tokens_crc32: crc32fast::hash(&tok),
        state_bytes: st.len(),
        state_crc32: crc32fast::hash(&st),
        created_unix: super::unix_now(),
    };
    let hj = serde_json::to_vec(&header)?;
    let path = dir.join(file_name(tokens));
    let tmp = path.with_extension(format!("{EXTENSION}.tmp"));
    let write = || -> std::io::Result<u64> {
        let mut f = File::create(&tmp)?;
        f.write_all(MAGIC)?;
        f.write_all(&FORMAT_VERSION.to_le_bytes())?;
        f.write_all(&(hj.len() as u32).to_le_bytes())?;
        f.write_all(&hj)?;
        f.write_all(&crc32fast::hash(&hj).to_le_bytes())?;
        f.write_all(&tok)?;
        f.write_all(&st)?;
        f.sync_all()?;
        let n = f.metadata()?.len();
        drop(f);
        fs::rename(&tmp, &path)?;
        Ok(n)
    };
    match write() {
        Ok(n) => {
            fsync_dir(dir);
            Ok((path, n))
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e).with_context(|| format!("writing the cache entry {}", path.display()))
        }
    }
}

/// Reads the header and tokens of an entry and checks them against `identity`.
fn read_head(f: &mut File, identity: &CacheIdentity) -> Result<(Header, Vec<u32>)> {
    let mut fixed = [0u8; 16];
    f.read_exact(&mut fixed)
        .context("the file is shorter than the fixed header")?;
    if &fixed[..8] != MAGIC {
        bail!("not a Capy Flash cache entry (bad magic)");
    }
    let version = u32::from_le_bytes(fixed[8..12].try_into().unwrap());
    if version != FORMAT_VERSION {
        bail!("cache format version {version}, this build reads version {FORMAT_VERSION}");
    }
    let hlen = u32::from_le_bytes(fixed[12..16].try_into().unwrap()) as usize;
    if hlen > 1 << 20 {
        bail!("the header claims {hlen} bytes");
    }
    let mut hj = vec![0u8; hlen + 4];
    f.read_exact(&mut hj).context("the header is truncated")?;
    let crc = u32::from_le_bytes(hj[hlen..].try_into().unwrap());
    hj.truncate(hlen);
    if crc32fast::hash(&hj) != crc {
        bail!("the header checksum does not match");
    }
    let header: Header = serde_json::from_slice(&hj).context("the header is not valid JSON")?;
    if header.model_id != identity.model_id || header.format != identity.format {
        bail!(
            "written for model \"{}\" ({}), but the loaded model is \"{}\" ({})",
            header.model_id,
            header.format,
            identity.model_id,
            identity.format
        );
    }
    let mut tok = vec![0u8; header.tokens * 4];
    f.read_exact(&mut tok)
        .context("the token section is truncated")?;
    if crc32fast::hash(&tok) != header.tokens_crc32 {
        bail!("the token section's checksum does not match");
    }
    Ok((header, bytes_to_u32s(&tok)))
}

/// Reads a whole entry, verifying everything; the tokens must be `expect_tokens` when given.
pub fn read_entry(
    path: &Path,
    identity: &CacheIdentity,
    expect_tokens: Option<&[u32]>,
) -> Result<HostState> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let (header, tokens) = read_head(&mut f, identity)?;
    if let Some(t) = expect_tokens {
        if t != tokens.as_slice() {
            bail!("the entry's tokens are not the ones indexed for it");
        }
    }
    let mut st = Vec::with_capacity(header.state_bytes);
    f.read_to_end(&mut st)
        .context("reading the state section")?;
    if st.len() != header.state_bytes {
        bail!(
            "the state section has {} bytes, the header says {}",
            st.len(),
            header.state_bytes
        );
    }
    if crc32fast::hash(&st) != header.state_crc32 {
        bail!("the state section's checksum does not match (the file is corrupt)");
    }
    let state = decode_state(&st)?;
    if state.len != tokens.len() {
        bail!(
            "the state holds {} tokens but the entry lists {}",
            state.len,
            tokens.len()
        );
    }
    Ok(state)
}

/// Lists the entries in `dir`, deleting leftover `.tmp` files and entries that fail their
/// header checks (returned as `(path, reason)`).
pub fn scan(dir: &Path, identity: &CacheIdentity) -> (Vec<Found>, Vec<(PathBuf, String)>) {
    let mut found = Vec::new();
    let mut rejected = Vec::new();
    let Ok(rd) = fs::read_dir(dir) else {
        return (found, rejected);
    };
    for e in rd.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".tmp") {
            let _ = fs::remove_file(&path);
            continue;
        }
        if path.extension().and_then(|x| x.to_str()) != Some(EXTENSION) {
            continue;
        }
        let res = File::open(&path)
            .map_err(anyhow::Error::from)
            .and_then(|mut f| {
                let (h, t) = read_head(&mut f, identity)?;
                if name != file_name(&t) {
                    bail!("the file name does not match its tokens");
                }
                Ok((h, t, f.metadata()?.len()))
            });
        match res {
            Ok((header, tokens, file_bytes)) => found.push(Found {
                path,
                header,
                tokens,
                file_bytes,
            }),
            Err(e) => {
                let _ = fs::remove_file(&path);
                rejected.push((path, format!("{e:#}")));
            }
        }
    }
    (found, rejected)
}
