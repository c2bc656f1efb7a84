//! Memory-mapped safetensors shards, single-file or sharded through
//! `model.safetensors.index.json`. Tensors are looked up by name and borrowed from the map.

use crate::tensor::{Bytes, DType, HostTensor};
use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

struct MappedFile(Mmap);
impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

struct Entry {
    shard: usize,
    dtype: DType,
    shape: Vec<usize>,
    start: usize,
    len: usize,
}

/// Bytes a shard's tensors borrow from: a memory map, or an in-memory buffer.
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// All tensors of a checkpoint, across its shards.
pub struct SafetensorStore {
    shards: Vec<(PathBuf, SharedBytes)>,
    entries: HashMap<String, Entry>,
}

fn convert_dtype(d: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype as S;
    Some(match d {
        S::F32 => DType::F32,
        S::F16 => DType::F16,
        S::BF16 => DType::BF16,
        S::F8_E4M3 => DType::F8E4M3,
        S::U8 => DType::U8,
        S::I8 => DType::I8,
        S::I32 => DType::I32,
        S::I64 => DType::I64,
        _ => return None,
    })
}

impl SafetensorStore {
    /// Opens `model.safetensors`, or every shard named in `model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index)
                .with_context(|| format!("cannot read {}", index.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", index.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("{} has no \"weight_map\" object", index.display()))?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_owned))
                .collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .with_context(|| format!("cannot list {}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            if found.is_empty() {
                bail!(
                    "no weights in {}: expected model.safetensors or model.safetensors.index.json with its shards",
                    dir.display()
                );
            }
            found
        };
        Self::open_files(&files)
    }

    /// Opens the given shard files.
    pub fn open_files(files: &[PathBuf]) -> Result<Self> {
        let mut store = SafetensorStore {
            shards: vec![],
            entries: HashMap::new(),
        };
        for path in files {
            store.add_file(path)?;
        }
        Ok(store)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = std::fs::File::open(path).with_context(|| {
            format!("weights shard {} is missing or unreadable", path.display())
        })?;
        // SAFETY: the checkpoint files are treated as read-only for the life of the process;
        // modifying them while the server runs is unsupported (as with every mmap-based loader).
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot memory-map {}", path.display()))?;
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map[..]).map_err(|e| {
            anyhow::anyhow!(
                "{} is not a valid safetensors file ({e}); {} bytes on disk. The file may be truncated or corrupt: download it again",
                path.display(),
                map.len()
            )
        })?;
        let base = 8 + header_len;
        let shard = self.shards.len();
        let mut tensors: BTreeMap<String, Entry> = BTreeMap::new();
        for (name, info) in meta.tensors() {
            let dtype = convert_dtype(info.dtype).with_context(|| {
                format!(
                    "tensor {name} in {} has unsupported dtype {:?}",
                    path.display(),
                    info.dtype
                )
            })?;
            let (s, e) = info.data_offsets;
            let numel: usize = info.shape.iter().product();
            if e - s != numel * dtype.size() {
                bail!(
                    "tensor {name} in {}: shape {:?} of {dtype} needs {} bytes but the header gives {}",
                    path.display(),
                    info.shape,
                    numel * dtype.size(),
                    e - s
                );
            }
            if base + e > map.len() {
                bail!(
                    "{} is truncated: tensor {name} ends at byte {} but the file has {} bytes; download it again",
                    path.display(),
                    base + e,
                    map.len()
                );
            }
            tensors.insert(
                name.clone(),
                Entry {
                    shard,
                    dtype,
                    shape: info.shape.clone(),
                    start: base + s,
                    len: e - s,
                },
            );
        }
        for (name, entry) in tensors {
            if self.entries.contains_key(&name) {
                bail!(
                    "tensor {name} appears in more than one shard (second: {})",
                    path.display()
                );
            }
            self.entries.insert(name, entry);
        }
        self.shards
            .push((path.to_path_buf(), Arc::new(MappedFile(map))));
        Ok(())
    }

    /// A store over one in-memory buffer (synthetic weights for benchmarks): each tensor is
    /// `(name, dtype, shape, byte offset)` into `buffer`; tensors may overlap. `label` stands in
    /// for the file name in messages.
    pub fn from_buffer(
        label: PathBuf,
        buffer: SharedBytes,
        tensors: Vec<(String, DType, Vec<usize>, usize)>,
    ) -> Result<Self> {
        let total = (*buffer).as_ref().len();
        let mut entries = HashMap::new();
        for (name, dtype, shape, start) in tensors {
            let len = shape.iter().product::<usize>() * dtype.size();
            if start + len > total {
                bail!("tensor {name} ({len} bytes at {start}) lies outside the {total}-byte buffer {}", label.display());
            }
            entries.insert(
                name,
                Entry {
                    shard: 0,
                    dtype,
                    shape,
                    start,
                    len,
                },
            );
        }
        Ok(SafetensorStore {
            shards: vec![(label, buffer)],
            entries,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The tensor called `name`, borrowed from its memory map.
    pub fn get(&self, name: &str) -> Result<HostTensor> {
        let e = self.entries.get(name).with_context(|| {
            let files: Vec<String> = self
                .shards
                .iter()
                .map(|(p, _)| p.display().to_string())
                .collect();
            format!(
                "tensor {name} is missing from the checkpoint ({})",
                files.join(", ")
            )
        })?;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.shards[e.shard].1.clone();
        Ok(HostTensor {
            name: name.to_owned(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            data: Bytes::slice_of(owner, e.start, e.len),
        })
    }

    /// The shard file a tensor comes from (for error messages).
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.entries
            .get(name)
            .map(|e| self.shards[e.shard].0.as_path())
    }
}

/// Writes tensors to a safetensors file (used by the demo model and tests).
pub fn write_safetensors(path: &Path, tensors: &[HostTensor]) -> Result<()> {
    use safetensors::tensor::{Dtype, TensorView};
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let dtype = match t.dtype {
                DType::F32 => Dtype::F32,
                DType::F16 => Dtype::F16,
                DType::BF16 => Dtype::BF16,
                DType::F8E4M3 => Dtype::F8_E4M3,
                DType::U8 => Dtype::U8,
                DType::I8 => Dtype::I8,
                DType::I32 => Dtype::I32,
                DType::I64 => Dtype::I64,
            };
            let view = TensorView::new(dtype, t.shape.clone(), t.data.as_slice())
                .map_err(|e| anyhow::anyhow!("tensor {}: {e}", t.name))?;
            Ok((t.name.clone(), view))
        })
        .collect::<Result<_>>()?;
    let tmp = path.with_extension("safetensors.partial");
    safetensors::serialize_to_file(views, None, &tmp)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot move {} into place", path.display()))?;
    Ok(())
}
