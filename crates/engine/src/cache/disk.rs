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
use std::io::{Read, Seek, Write};
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
    let pieces = state_pieces(s);
    let mut out = Vec::with_capacity(pieces.iter().map(|p| p.len()).sum());
    for p in &pieces {
        out.extend_from_slice(p);
    }
    out
}

/// The state section as consecutive byte pieces: the small headers owned, the tensors' data
/// borrowed (their in-memory bytes are the little-endian encoding), so a write neither copies
/// the state nor holds a second one in memory.
fn state_pieces(s: &HostState) -> Vec<std::borrow::Cow<'_, [u8]>> {
    use std::borrow::Cow;
    let mut pieces: Vec<Cow<'_, [u8]>> = Vec::with_capacity(2 * s.tensors.len() + 4);
    let mut head = Vec::with_capacity(12);
    head.extend((s.len as u64).to_le_bytes());
    head.extend((s.tensors.len() as u32).to_le_bytes());
    pieces.push(Cow::Owned(head));
    for t in &s.tensors {
        let mut shape = Vec::with_capacity(8);
        shape.extend((t.rows as u32).to_le_bytes());
        shape.extend((t.cols as u32).to_le_bytes());
        pieces.push(Cow::Owned(shape));
        pieces.push(f32_bytes(&t.data));
    }
    let mut ids = Vec::with_capacity(4 + s.ids.iter().map(|i| 4 + 4 * i.len()).sum::<usize>());
    ids.extend((s.ids.len() as u32).to_le_bytes());
    for list in &s.ids {
        ids.extend((list.len() as u32).to_le_bytes());
        ids.extend(u32s_to_bytes(list));
    }
    pieces.push(Cow::Owned(ids));
    pieces
}

/// The little-endian bytes of f32 values: borrowed where memory is little-endian already.
fn f32_bytes(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: any f32 is 4 initialised bytes; u8 has alignment 1.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v))
        })
    } else {
        std::borrow::Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
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
    let started = std::time::Instant::now();
    let tok = u32s_to_bytes(tokens);
    let pieces = state_pieces(state);
    let state_bytes: usize = pieces.iter().map(|p| p.len()).sum();
    let header = Header {
        model_id: identity.model_id.clone(),
        format: identity.format.clone(),
        session: session.to_string(),
        tokens: tokens.len(),
        tokens_crc32: crc32fast::hash(&tok),
        state_bytes,
        state_crc32: crc_of_pieces(&pieces),
        created_unix: super::unix_now(),
    };
    let checksummed = started.elapsed();
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
        for p in &pieces {
            f.write_all(p)?;
        }
        f.sync_all()?;
        let n = f.metadata()?.len();
        drop(f);
        fs::rename(&tmp, &path)?;
        Ok(n)
    };
    match write() {
        Ok(n) => {
            fsync_dir(dir);
            tracing::info!(
                target: "capy::cache",
                tokens = tokens.len(),
                bytes = n,
                crc_ms = checksummed.as_secs_f64() * 1e3,
                write_ms = (started.elapsed() - checksummed).as_secs_f64() * 1e3,
                "disk write: entry written (writer thread)"
            );
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

/// The CRC-32 of consecutive pieces, the large ones hashed on several threads and combined.
fn crc_of_pieces(pieces: &[std::borrow::Cow<'_, [u8]>]) -> u32 {
    let ranges: Vec<&[u8]> = pieces
        .iter()
        .flat_map(|p| p.chunks(CRC_PIECE_BYTES.max(1)))
        .collect();
    let threads = io_threads().min(ranges.len()).max(1);
    let mut partial: Vec<Option<crc32fast::Hasher>> = vec![None; ranges.len()];
    std::thread::scope(|s| {
        let slots: Vec<_> = partial.chunks_mut(ranges.len().div_ceil(threads)).collect();
        let mut start = 0;
        for slot in slots {
            let mine = &ranges[start..start + slot.len()];
            start += slot.len();
            s.spawn(move || {
                for (out, r) in slot.iter_mut().zip(mine) {
                    let mut h = crc32fast::Hasher::new();
                    h.update(r);
                    *out = Some(h);
                }
            });
        }
    });
    let mut all = crc32fast::Hasher::new();
    for h in partial.into_iter().flatten() {
        all.combine(&h);
    }
    all.finalize()
}

/// Bytes one thread reads (and checksums) at a time.
const CRC_PIECE_BYTES: usize = 64 << 20;

/// Threads reading or checksumming a state: memory bandwidth and the page cache scale to a
/// few threads; more only contend.
fn io_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
}

/// Reads a whole entry, verifying everything; the tokens must be `expect_tokens` when given.
///
/// The state section is read straight into the tensors' final buffers by several threads at
/// once (positioned reads of disjoint ranges), each checksumming its ranges; the CRC-32s are
/// combined in file order and checked before the state is returned.
pub fn read_entry(
    path: &Path,
    identity: &CacheIdentity,
    expect_tokens: Option<&[u32]>,
) -> Result<HostState> {
    use std::os::unix::fs::FileExt;
    let started = std::time::Instant::now();
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let (header, tokens) = read_head(&mut f, identity)?;
    if let Some(t) = expect_tokens {
        if t != tokens.as_slice() {
            bail!("the entry's tokens are not the ones indexed for it");
        }
    }
    let state_start = f.stream_position().context("finding the state section")?;
    let file_len = f.metadata().context("reading the file's size")?.len();
    let state_bytes = file_len.saturating_sub(state_start);
    if state_bytes != header.state_bytes as u64 {
        bail!(
            "the state section has {state_bytes} bytes, the header says {}",
            header.state_bytes
        );
    }
    // Walk the small headers of the layout (positioned reads), so every tensor's buffer can be
    // allocated and its file range known before the bulk read.
    let end = state_start + state_bytes;
    let mut pos = state_start;
    let small = |n: usize, pos: &mut u64| -> Result<Vec<u8>> {
        if *pos + n as u64 > end {
            bail!(
                "the state section ends at byte {} but needs {n} more from {}",
                end - state_start,
                *pos - state_start
            );
        }
        let mut b = vec![0u8; n];
        f.read_exact_at(&mut b, *pos)
            .context("reading the state section")?;
        *pos += n as u64;
        Ok(b)
    };
    let u32_of = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    // (file offset, in-memory bytes) of every range, in file order; tensors' data are placed later.
    let mut head_pieces: Vec<(u64, Vec<u8>)> = Vec::new();
    let head = small(12, &mut pos)?;
    let len = u64::from_le_bytes(head[..8].try_into().unwrap()) as usize;
    let n_tensors = u32_of(&head[8..]);
    head_pieces.push((pos - 12, head));
    let mut shapes = Vec::with_capacity(n_tensors.min(1 << 16));
    for _ in 0..n_tensors {
        let shape = small(8, &mut pos)?;
        let (rows, cols) = (u32_of(&shape), u32_of(&shape[4..]));
        head_pieces.push((pos - 8, shape));
        let n = rows
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(4))
            .filter(|&n| pos + n as u64 <= end)
            .with_context(|| {
                format!(
                    "tensor [{rows}, {cols}] at byte {} runs past the state section's end",
                    pos - state_start
                )
            })?;
        shapes.push((rows, cols, pos));
        pos += n as u64;
    }
    let ids_start = pos;
    let ids_bytes = small((end - pos) as usize, &mut pos)?;
    head_pieces.push((ids_start, ids_bytes.clone()));
    let ids = decode_ids(&ids_bytes)?;
    let walked = started.elapsed();

    let mut tensors: Vec<HostPart> = shapes
        .iter()
        .map(|&(rows, cols, _)| HostPart {
            rows,
            cols,
            data: crate::tensor::bulk_f32(rows * cols),
        })
        .collect();
    // Bulk ranges: (order key = file offset, file offset, destination bytes).
    let mut bulk: Vec<(u64, &mut [u8])> = Vec::new();
    for (t, &(_, _, at)) in tensors.iter_mut().zip(&shapes) {
        // SAFETY: any 4 bytes are a valid f32; the slice covers exactly the Vec's values.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                t.data.as_mut_ptr() as *mut u8,
                std::mem::size_of_val(t.data.as_slice()),
            )
        };
        let mut off = at;
        for piece in bytes.chunks_mut(CRC_PIECE_BYTES) {
            let n = piece.len() as u64;
            bulk.push((off, piece));
            off += n;
        }
    }
    let threads = io_threads().min(bulk.len()).max(1);
    let per = bulk.len().div_ceil(threads).max(1);
    let file = &f;
    let results: Vec<Result<Vec<(u64, crc32fast::Hasher)>>> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        let mut rest = bulk;
        while !rest.is_empty() {
            let tail = rest.split_off(per.min(rest.len()));
            let mine = std::mem::replace(&mut rest, tail);
            handles.push(s.spawn(move || -> Result<Vec<(u64, crc32fast::Hasher)>> {
                let mut out = Vec::with_capacity(mine.len());
                for (off, dst) in mine {
                    file.read_exact_at(dst, off)
                        .context("reading the state section")?;
                    let mut h = crc32fast::Hasher::new();
                    h.update(dst);
                    out.push((off, h));
                }
                Ok(out)
            }));
        }
        handles
            .into_iter()
            .map(|h| h.join().expect("a cache reader thread panicked"))
            .collect()
    });
    let read = started.elapsed();
    let mut parts: Vec<(u64, crc32fast::Hasher)> = head_pieces
        .iter()
        .map(|(off, b)| {
            let mut h = crc32fast::Hasher::new();
            h.update(b);
            (*off, h)
        })
        .collect();
    for r in results {
        parts.extend(r?);
    }
    parts.sort_by_key(|p| p.0);
    let mut crc = crc32fast::Hasher::new();
    for (_, h) in &parts {
        crc.combine(h);
    }
    if crc.finalize() != header.state_crc32 {
        bail!("the state section's checksum does not match (the file is corrupt)");
    }
    if cfg!(target_endian = "big") {
        for t in &mut tensors {
            for x in &mut t.data {
                *x = f32::from_bits(u32::from_le(x.to_bits()));
            }
        }
    }
    if len != tokens.len() {
        bail!(
            "the state holds {len} tokens but the entry lists {}",
            tokens.len()
        );
    }
    let state = HostState { len, tensors, ids };
    tracing::info!(
        target: "capy::cache",
        tokens = len,
        bytes = state_bytes,
        threads,
        layout_ms = walked.as_secs_f64() * 1e3,
        read_and_crc_ms = (read - walked).as_secs_f64() * 1e3,
        total_ms = started.elapsed().as_secs_f64() * 1e3,
        "disk read: entry read and verified"
    );
    Ok(state)
}

/// The id lists at the end of the state section: `u32 lists | (u32 n, u32 × n)*`, exactly.
fn decode_ids(b: &[u8]) -> Result<Vec<Vec<u32>>> {
    let mut pos = 0usize;
    let mut take = |n: usize| -> Result<&[u8]> {
        let end = pos
            .checked_add(n)
            .filter(|&e| e <= b.len())
            .with_context(|| {
                format!(
                    "the id lists end at byte {} but need {n} more from {pos}",
                    b.len()
                )
            })?;
        let s = &b[pos..end];
        pos = end;
        Ok(s)
    };
    let u32_at = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize;
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
    Ok(ids)
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

/// Asks the kernel to drop the page cache of every entry file under `dir` (and its identity
/// folders), so the next read of them comes from the disk itself: benchmarks measure a cold
/// resume this way. Returns `(files, bytes)` advised. Files are fsynced when written, so their
/// pages are clean and can be dropped.
pub fn drop_from_page_cache(dir: &Path) -> Result<(usize, u64)> {
    let mut files = 0usize;
    let mut bytes = 0u64;
    let mut folders = vec![dir.to_path_buf()];
    while let Some(d) = folders.pop() {
        let rd = fs::read_dir(&d).with_context(|| format!("listing {}", d.display()))?;
        for e in rd.flatten() {
            let path = e.path();
            if path.is_dir() {
                folders.push(path);
                continue;
            }
            if path.extension().and_then(|x| x.to_str()) != Some(EXTENSION) {
                continue;
            }
            let f = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            let len = f.metadata()?.len();
            #[cfg(target_os = "linux")]
            {
                use std::os::fd::AsRawFd;
                // SAFETY: advice on an open descriptor; it changes no data.
                let r =
                    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
                if r != 0 {
                    bail!(
                        "posix_fadvise(DONTNEED) on {} failed: {}",
                        path.display(),
                        std::io::Error::from_raw_os_error(r)
                    );
                }
            }
            files += 1;
            bytes += len;
        }
    }
    Ok((files, bytes))
}
