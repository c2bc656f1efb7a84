//! The prefix cache for agent sessions: exact resumption of a conversation's state.
//!
//! **Index.** Token sequences are cut into blocks of `block_tokens`; block `k`'s key is a hash
//! chained over blocks `0..=k`, so a key names a whole prefix and the keys form a trie stored
//! flat in a map (a node exists while some entry lies at or below it). An entry is a token
//! sequence (its exact tokens are kept and compared, so a hash collision can never resume the
//! wrong state) and the model's full state after it ([`HostState`]: attention KV, QSA indexer
//! keys, GDN conv and recurrent states, PLE n-gram context, whatever the model writes).
//!
//! **Capture.** The scheduler stores an entry at block boundaries within prefill (every
//! `capture_every_blocks` blocks up to 8192 tokens and at doublings of that spacing beyond,
//! since each entry copies the whole state; and always at the last boundary before the
//! prompt's end, so
//! the next turn hits even when its re-rendered history differs in the last few tokens) and
//! at the end of every turn (prompt plus generated tokens). A request resumes from the deepest
//! entry whose tokens are a prefix of its prompt (leaving at least one token to compute).
//!
//! **Tiers.** RAM (host memory, `ram_bytes`) and, when enabled, disk (`disk_bytes`, one
//! checksummed file per entry, see [`disk`]). Sessions idle for `idle` move their entries to
//! disk; a hit on a disk entry reads it back into RAM (the file stays, so moving down again
//! costs nothing). After a restart the disk folder is scanned and its entries are found again.
//! Above them, the scheduler keeps finished sessions' sequences live on the model's device
//! (parked, see `scheduler::parked`): a session's next turn continues on its sequence without
//! any copy. The cache only lists them ([`PrefixCache::set_parked`], tier `vram` in
//! [`PrefixCache::status`]) and counts their hits ([`PrefixCache::resume_parked`]); a parked
//! sequence that leaves the device is exported into the RAM tier.
//!
//! **Disk writes** run on a writer thread of the cache, never on the scheduler's: an entry
//! moving down is queued (its RAM is counted as leaving, so eviction does not pick it again)
//! and leaves RAM when its file is written (atomically, checksummed, see [`disk`]); the
//! results are picked up by the next call into the cache (`begin`, `insert`, `maintain` run
//! every second). RAM use can therefore exceed its budget by the writes in flight.
//! [`PrefixCache::flush_to_disk`] and [`PrefixCache::wait_writes`] wait for the queue.
//!
//! **Eviction** (when a tier is over budget), in this order:
//! 1. entries that are not their session's deepest, least recently used first (dropped from
//!    RAM, or deleted from disk);
//! 2. then sessions' deepest entries, least recently used session first: from RAM they move to
//!    disk when disk offload is on (dropped otherwise); from disk they are deleted.
//!
//! So one session's new entries push out every other session's intermediate snapshots before
//! they touch another session's deepest (its conversation so far), and the deepest entries
//! only give way to one another by recency. An entry larger than the whole RAM budget is not
//! stored.
//!
//! Under RAM pressure with disk offload on, evicted entries (intermediate snapshots first,
//! then sessions' deepest) are written to disk rather than dropped; the disk budget then
//! deletes in the same order.
//!
//! **Expert heat.** Each session keeps the routing heat of its turns
//! ([`SessionInfo::expert_heat`], merged by [`PrefixCache::merge_heat`] with the older turns
//! halved), so that when the session becomes active again the scheduler can ask the model to
//! prefetch its hot experts ([`crate::model::CausalLm::prefetch_experts`]). Heat lives with the
//! session in RAM; it is not written to disk entries.

pub mod disk;
pub mod state;

pub use disk::CacheIdentity;
pub use state::{HostPart, HostReader, HostState};

use crate::hybrid::expert_cache::HeatEntry;

use anyhow::{Context, Result};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Settings of the prefix cache.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Tokens per block of the index; prefill chunks end on block boundaries.
    pub block_tokens: usize,
    /// Within prefill, a snapshot every this many blocks up to
    /// [`crate::scheduler::REGULAR_CAPTURE_TOKENS`], then at doublings (besides the last
    /// boundary).
    pub capture_every_blocks: usize,
    /// RAM tier budget.
    pub ram_bytes: usize,
    /// Disk tier budget.
    pub disk_bytes: u64,
    /// Disk offload folder; `None` keeps the cache in RAM only.
    pub disk_dir: Option<PathBuf>,
    /// A session without requests for this long moves to disk (when disk offload is on).
    pub idle: Duration,
    /// What disk entries must match.
    pub identity: CacheIdentity,
    /// The VRAM tier: finished sessions' sequences kept live on the model's device for their
    /// next turn (parked by the scheduler), at most this many; 0 turns it off (every turn is
    /// then copied to RAM).
    pub max_parked: usize,
    /// ... holding at most this many bytes of state in all (KV, recurrent states and their
    /// checkpoints), beside the running sequences.
    pub parked_bytes: usize,
}

impl CacheConfig {
    pub fn new(identity: CacheIdentity) -> Self {
        CacheConfig {
            block_tokens: 64,
            capture_every_blocks: 32,
            ram_bytes: 4 << 30,
            disk_bytes: 64 << 30,
            disk_dir: None,
            idle: Duration::from_secs(300),
            identity,
            max_parked: 4,
            parked_bytes: 8 << 30,
        }
    }
}

/// Where an entry's state is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// A parked sequence on the model's device (listed by the scheduler).
    Vram,
    Ram,
    Disk,
}

/// A session's parked sequence, as the scheduler reports it.
#[derive(Debug, Clone, Copy)]
struct ParkedInfo {
    tokens: usize,
    bytes: usize,
}

struct Entry {
    session: String,
    tokens: Arc<[u32]>,
    ram: Option<Arc<HostState>>,
    disk: Option<(PathBuf, u64)>,
    /// State bytes in RAM (tokens included).
    bytes: usize,
    last_used: f64,
    /// Tie-breaker for equal times: a global counter.
    tick: u64,
    /// Queued on the writer thread (still in RAM until written).
    writing: bool,
    /// Writing it to disk failed once: it is not tried again (dropped under pressure).
    no_disk: bool,
}

/// A state to write to disk, on the writer thread.
struct WriteJob {
    id: u64,
    dir: PathBuf,
    identity: CacheIdentity,
    session: String,
    tokens: Arc<[u32]>,
    state: Arc<HostState>,
}

struct WriteDone {
    id: u64,
    dir: PathBuf,
    result: std::result::Result<(PathBuf, u64), String>,
}

enum ToWriter {
    Write(Box<WriteJob>),
    /// Answered once every job before it is done.
    Barrier(mpsc::Sender<()>),
    /// Tests: each later write first waits for a message on this channel.
    #[cfg(test)]
    Gate(mpsc::Receiver<()>),
}

/// The writer thread and its channels.
struct Writer {
    tx: mpsc::Sender<ToWriter>,
    done: mpsc::Receiver<WriteDone>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn spawn() -> Writer {
        let (tx, rx) = mpsc::channel::<ToWriter>();
        let (done_tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("capy-cache-writer".into())
            .spawn(move || {
                #[cfg(test)]
                let mut gate: Option<mpsc::Receiver<()>> = None;
                for m in rx {
                    match m {
                        ToWriter::Write(j) => {
                            #[cfg(test)]
                            if let Some(g) = &gate {
                                if g.recv().is_err() {
                                    gate = None;
                                }
                            }
                            let result = disk::write_entry(
                                &j.dir,
                                &j.identity,
                                &j.session,
                                &j.tokens,
                                &j.state,
                            )
                            .map_err(|e| format!("{e:#}"));
                            let d = WriteDone {
                                id: j.id,
                                dir: j.dir,
                                result,
                            };
                            if done_tx.send(d).is_err() {
                                return;
                            }
                        }
                        ToWriter::Barrier(b) => {
                            let _ = b.send(());
                        }
                        #[cfg(test)]
                        ToWriter::Gate(g) => gate = Some(g),
                    }
                }
            })
            .expect("spawning the prefix cache's disk writer");
        Writer {
            tx,
            done,
            thread: Some(thread),
        }
    }
}

/// A session: the entries it created and when it was last active.
#[derive(Debug, Clone, Default)]
pub struct SessionInfo {
    pub last_used: f64,
    /// Routing heat of this session's turns (hottest first, at most [`MAX_HEAT_ENTRIES`]), to
    /// prefetch its hot experts when it becomes active again. Empty for models without
    /// routed experts.
    pub expert_heat: Vec<HeatEntry>,
}

/// Experts of heat kept per session (all layers together).
pub const MAX_HEAT_ENTRIES: usize = 4096;

/// A resumable state found for a prompt.
pub struct Hit {
    pub len: usize,
    pub state: Arc<HostState>,
    pub tier: Tier,
    pub entry: u64,
}

/// The outcome of looking a request up.
pub struct Begin {
    /// The session the request's entries belong to.
    pub session: String,
    pub hit: Option<Hit>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct SessionStatus {
    pub id: String,
    pub tier: Tier,
    /// Tokens of its deepest entry.
    pub tokens: usize,
    /// Bytes of all its entries (RAM and disk).
    pub bytes: u64,
    pub entries: usize,
    pub last_used_s: f64,
    /// Experts in the session's routing heat (0 without routed experts).
    pub hot_experts: usize,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Budgets {
    pub ram_bytes: u64,
    pub disk_bytes: u64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DiskOffload {
    pub enabled: bool,
    pub dir: Option<String>,
}

/// What `/admin/status` shows.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CacheStatus {
    pub sessions: Vec<SessionStatus>,
    pub budgets: Budgets,
    #[serde(rename = "use")]
    pub usage: Budgets,
    pub disk_offload: DiskOffload,
    pub hits: u64,
    pub misses: u64,
    pub cached_tokens: u64,
    pub block_tokens: usize,
    /// Disk entries rejected (corrupt, truncated, other model) since start.
    pub disk_rejected: u64,
}

pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// A stable 64-bit hash of a token sequence (file names).
pub fn tokens_hash(tokens: &[u32]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    tokens.hash(&mut h);
    h.finish()
}

/// Chained block keys: `keys[k]` names `tokens[..(k+1)·block]`.
fn block_keys(tokens: &[u32], block: usize) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks_exact(block)
        .map(|b| {
            let mut h = std::hash::DefaultHasher::new();
            prev.hash(&mut h);
            b.hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

#[derive(Default)]
struct Node {
    /// Entries at or below this node.
    below: usize,
    /// Entries whose full blocks end at this node.
    here: Vec<u64>,
}

pub struct PrefixCache {
    config: CacheConfig,
    /// Per-identity disk folder, when disk offload is on.
    disk: Option<PathBuf>,
    entries: HashMap<u64, Entry>,
    /// Node key (chained block hash; 0 = the root, entries shorter than a block) → node.
    nodes: HashMap<u64, Node>,
    sessions: HashMap<String, SessionInfo>,
    next_id: u64,
    tick: u64,
    ram_use: usize,
    disk_use: u64,
    pub hits: u64,
    pub misses: u64,
    pub cached_tokens: u64,
    pub disk_rejected: u64,
    /// Off: no lookups, no captures (switched at run time, e.g. by a benchmark that measures
    /// the same loaded model without a cache).
    enabled: bool,
    /// Disk writes in flight (started on first use).
    writer: Option<Writer>,
    /// RAM bytes of the entries queued for writing (they leave RAM when written).
    ram_leaving: usize,
    /// Sessions with a parked sequence on the device (the scheduler's VRAM tier).
    parked: HashMap<String, ParkedInfo>,
}

impl Drop for PrefixCache {
    fn drop(&mut self) {
        // Let queued writes finish (their files are complete or absent, never partial).
        if let Some(mut w) = self.writer.take() {
            drop(w.tx);
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl PrefixCache {
    /// An empty cache; with a disk folder, the entries already there are indexed.
    pub fn new(mut config: CacheConfig) -> Result<Self> {
        config.block_tokens = config.block_tokens.max(1);
        config.capture_every_blocks = config.capture_every_blocks.max(1);
        let dir = config.disk_dir.take();
        let mut c = PrefixCache {
            config,
            disk: None,
            entries: HashMap::new(),
            nodes: HashMap::new(),
            sessions: HashMap::new(),
            next_id: 1,
            tick: 0,
            ram_use: 0,
            disk_use: 0,
            hits: 0,
            misses: 0,
            cached_tokens: 0,
            disk_rejected: 0,
            enabled: true,
            writer: None,
            ram_leaving: 0,
            parked: HashMap::new(),
        };
        if let Some(d) = dir {
            c.set_disk(Some(&d))?;
        }
        Ok(c)
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    pub fn block_tokens(&self) -> usize {
        self.config.block_tokens
    }

    pub fn set_ram_budget(&mut self, bytes: usize) {
        self.config.ram_bytes = bytes;
        self.enforce_budgets();
    }

    pub fn set_disk_budget(&mut self, bytes: u64) {
        self.config.disk_bytes = bytes;
        self.enforce_budgets();
    }

    /// Switches lookups and captures on or off; switching off drops the RAM tier's entries
    /// (disk files stay, for when it is switched on again).
    pub fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
        if !on {
            let ids: Vec<u64> = self.entries.keys().copied().collect();
            for id in ids {
                if self.entries[&id].ram.is_some() {
                    self.drop_from_ram(id);
                }
            }
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    pub fn set_idle(&mut self, idle: Duration) {
        self.config.idle = idle;
    }

    /// Turns disk offload on (in `dir`) or off. Turning it on indexes the entries already in
    /// the folder; turning it off forgets disk-only entries (their files stay for next time).
    pub fn set_disk(&mut self, dir: Option<&Path>) -> Result<()> {
        self.poll_writes();
        if let Some(dir) = dir {
            let sub = dir.join(self.config.identity.folder_name());
            std::fs::create_dir_all(&sub).with_context(|| {
                format!(
                    "cannot create the disk cache folder {}; choose a writable folder",
                    sub.display()
                )
            })?;
            if self.disk.as_deref() == Some(sub.as_path()) {
                return Ok(());
            }
            self.set_disk(None)?;
            let (found, rejected) = disk::scan(&sub, &self.config.identity);
            for (path, why) in rejected {
                tracing::warn!("prefix cache: discarded {}: {why}", path.display());
                self.disk_rejected += 1;
            }
            self.disk = Some(sub);
            for f in found {
                if self.find_exact(&f.tokens).is_some() {
                    continue;
                }
                let id = self.add_entry(
                    f.header.session.clone(),
                    f.tokens.into(),
                    None,
                    0,
                    f.header.created_unix,
                );
                self.entries.get_mut(&id).unwrap().disk = Some((f.path, f.file_bytes));
                self.disk_use += f.file_bytes;
            }
            self.enforce_budgets();
        } else {
            self.disk = None;
            let ids: Vec<u64> = self.entries.keys().copied().collect();
            for id in ids {
                let e = self.entries.get_mut(&id).unwrap();
                if e.disk.take().is_some() && e.ram.is_none() {
                    self.remove_entry(id);
                }
            }
            self.disk_use = 0;
        }
        Ok(())
    }

    pub fn disk_dir(&self) -> Option<&Path> {
        self.disk.as_deref()
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn add_entry(
        &mut self,
        session: String,
        tokens: Arc<[u32]>,
        ram: Option<Arc<HostState>>,
        bytes: usize,
        last_used: f64,
    ) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let keys = block_keys(&tokens, self.config.block_tokens);
        self.nodes.entry(0).or_default().below += 1;
        for k in &keys {
            self.nodes.entry(*k).or_default().below += 1;
        }
        let at = keys.last().copied().unwrap_or(0);
        self.nodes.get_mut(&at).unwrap().here.push(id);
        let s = self.sessions.entry(session.clone()).or_default();
        s.last_used = s.last_used.max(last_used);
        if ram.is_some() {
            self.ram_use += bytes;
        }
        let tick = self.next_tick();
        self.entries.insert(
            id,
            Entry {
                session,
                tokens,
                ram,
                disk: None,
                bytes,
                last_used,
                tick,
                writing: false,
                no_disk: false,
            },
        );
        id
    }

    fn remove_entry(&mut self, id: u64) {
        let Some(e) = self.entries.remove(&id) else {
            return;
        };
        if e.ram.is_some() {
            self.ram_use -= e.bytes;
            if e.writing {
                self.ram_leaving -= e.bytes;
            }
        }
        if let Some((path, n)) = &e.disk {
            let _ = std::fs::remove_file(path);
            self.disk_use = self.disk_use.saturating_sub(*n);
        }
        let keys = block_keys(&e.tokens, self.config.block_tokens);
        let at = keys.last().copied().unwrap_or(0);
        if let Some(n) = self.nodes.get_mut(&at) {
            n.here.retain(|&x| x != id);
        }
        for k in std::iter::once(0).chain(keys) {
            if let Some(n) = self.nodes.get_mut(&k) {
                n.below -= 1;
                if n.below == 0 {
                    self.nodes.remove(&k);
                }
            }
        }
        if !self.entries.values().any(|x| x.session == e.session) {
            self.sessions.remove(&e.session);
        }
    }

    fn find_exact(&self, tokens: &[u32]) -> Option<u64> {
        let keys = block_keys(tokens, self.config.block_tokens);
        let at = keys.last().copied().unwrap_or(0);
        self.nodes
            .get(&at)?
            .here
            .iter()
            .copied()
            .find(|id| *self.entries[id].tokens == *tokens)
    }

    /// True when no entry holds exactly these tokens (worth capturing).
    pub fn wants(&self, tokens: &[u32]) -> bool {
        self.enabled && !tokens.is_empty() && self.find_exact(tokens).is_none()
    }

    /// Entries usable for `prompt` (a prefix of it of at most `max_len` tokens), deepest first.
    fn candidates(&self, prompt: &[u32], max_len: usize) -> Vec<u64> {
        let mut out: Vec<u64> = Vec::new();
        let mut visit = |node: &Node| {
            for id in &node.here {
                let t = &self.entries[id].tokens;
                if t.len() <= max_len && prompt.starts_with(t) {
                    out.push(*id);
                }
            }
        };
        if let Some(root) = self.nodes.get(&0) {
            visit(root);
        }
        for k in block_keys(prompt, self.config.block_tokens) {
            match self.nodes.get(&k) {
                Some(n) => visit(n),
                None => break,
            }
        }
        out.sort_by_key(|id| std::cmp::Reverse(self.entries[id].tokens.len()));
        out
    }

    /// The deepest entry of a session (its conversation so far).
    fn deepest_of(&self, session: &str) -> Option<u64> {
        self.entries
            .iter()
            .filter(|(_, e)| e.session == session)
            .max_by_key(|(_, e)| (e.tokens.len(), e.tick))
            .map(|(id, _)| *id)
    }

    /// Looks a request up: the deepest usable state (read back from disk if it is there) and
    /// the session its new entries belong to (`key`, else the session it continues, else a
    /// new one). `max_len` is the most tokens a hit may cover (the prompt minus one).
    pub fn begin(&mut self, prompt: &[u32], max_len: usize, key: Option<&str>) -> Begin {
        self.poll_writes();
        let now = unix_now();
        let mut hit = None;
        let found = if self.enabled {
            self.candidates(prompt, max_len)
        } else {
            Vec::new()
        };
        for id in found {
            match self.load(id) {
                Ok((state, from_disk)) => {
                    let tier = if from_disk { Tier::Disk } else { Tier::Ram };
                    hit = Some(Hit {
                        len: self.entries[&id].tokens.len(),
                        state,
                        tier,
                        entry: id,
                    });
                    break;
                }
                Err(e) => {
                    tracing::warn!("prefix cache: discarded an entry: {e:#}");
                    self.disk_rejected += 1;
                    self.remove_entry(id);
                }
            }
        }
        let session = match (key, &hit) {
            (Some(k), _) => k.to_string(),
            (None, Some(h)) => {
                let s = self.entries[&h.entry].session.clone();
                // Continuing a conversation's tip makes the request part of it; a hit on a
                // shared shallower prefix (a common system prompt) does not.
                if self.deepest_of(&s) == Some(h.entry) {
                    s
                } else {
                    self.new_session_id()
                }
            }
            (None, None) => self.new_session_id(),
        };
        let tick = self.next_tick();
        if let Some(h) = &hit {
            let e = self.entries.get_mut(&h.entry).unwrap();
            e.last_used = now;
            e.tick = tick;
            self.hits += 1;
            self.cached_tokens += h.len as u64;
        } else {
            self.misses += 1;
        }
        self.sessions.entry(session.clone()).or_default().last_used = now;
        self.enforce_budgets();
        Begin { session, hit }
    }

    fn new_session_id(&mut self) -> String {
        let t = self.next_tick();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        format!(
            "auto-{:012x}",
            (nanos ^ t.rotate_left(40)) & 0xffff_ffff_ffff
        )
    }

    /// The entry's state in RAM (reading it from disk if needed); the flag says it came from
    /// disk.
    fn load(&mut self, id: u64) -> Result<(Arc<HostState>, bool)> {
        let e = &self.entries[&id];
        if let Some(s) = &e.ram {
            return Ok((s.clone(), false));
        }
        let (path, _) = e
            .disk
            .clone()
            .context("a cache entry is in neither RAM nor disk")?;
        let state = disk::read_entry(&path, &self.config.identity, Some(&e.tokens))
            .with_context(|| format!("{}", path.display()))?;
        let bytes = state.bytes() + e.tokens.len() * 4;
        let state = Arc::new(state);
        let e = self.entries.get_mut(&id).unwrap();
        e.ram = Some(state.clone());
        e.bytes = bytes;
        self.ram_use += bytes;
        Ok((state, true))
    }

    /// Tokens of the deepest entry usable for `prompt` (at most `max_len`), 0 when none; an
    /// index lookup only, nothing is read.
    pub fn deepest_len(&self, prompt: &[u32], max_len: usize) -> usize {
        if !self.enabled {
            return 0;
        }
        self.candidates(prompt, max_len)
            .first()
            .map_or(0, |id| self.entries[id].tokens.len())
    }

    /// Records a request resumed from a parked sequence of `parked_session` at `len` tokens (a
    /// hit like any other); returns the session the request belongs to (`key`, else the
    /// parked one's: it continues that conversation).
    pub fn resume_parked(&mut self, key: Option<&str>, parked_session: &str, len: usize) -> String {
        self.poll_writes();
        let session = key.unwrap_or(parked_session).to_string();
        self.hits += 1;
        self.cached_tokens += len as u64;
        self.sessions.entry(session.clone()).or_default().last_used = unix_now();
        session
    }

    /// Lists (or, with `None`, unlists) `session`'s parked sequence: `(tokens, bytes)`.
    pub fn set_parked(&mut self, session: &str, parked: Option<(usize, usize)>) {
        match parked {
            Some((tokens, bytes)) => {
                self.parked
                    .insert(session.to_string(), ParkedInfo { tokens, bytes });
            }
            None => {
                self.parked.remove(session);
            }
        }
    }

    /// Sessions with a parked sequence and its tokens (tests and diagnostics).
    pub fn parked_sessions(&self) -> Vec<(String, usize)> {
        let mut v: Vec<(String, usize)> = self
            .parked
            .iter()
            .map(|(s, p)| (s.clone(), p.tokens))
            .collect();
        v.sort();
        v
    }

    /// Stores the state after `tokens` for `session` (no-op when already stored).
    pub fn insert(&mut self, session: &str, tokens: &[u32], state: HostState) {
        self.poll_writes();
        if let Some(id) = self.find_exact(tokens) {
            let t = self.next_tick();
            let e = self.entries.get_mut(&id).unwrap();
            e.last_used = unix_now();
            e.tick = t;
            return;
        }
        if state.len != tokens.len() {
            tracing::error!(
                "prefix cache: a state of {} tokens offered for {} tokens; not stored",
                state.len,
                tokens.len()
            );
            return;
        }
        let bytes = state.bytes() + tokens.len() * 4;
        if bytes > self.config.ram_bytes {
            return;
        }
        let now = unix_now();
        self.add_entry(
            session.to_string(),
            tokens.into(),
            Some(Arc::new(state)),
            bytes,
            now,
        );
        self.enforce_budgets();
    }

    /// Drops an entry (after its state failed to load into the model).
    pub fn discard(&mut self, entry: u64) {
        self.remove_entry(entry);
    }

    /// True for the deepest entry of its session.
    fn protected_set(&self) -> std::collections::HashSet<u64> {
        let mut best: HashMap<&str, (usize, u64, u64)> = HashMap::new();
        for (id, e) in &self.entries {
            let k = (e.tokens.len(), e.tick, *id);
            let b = best.entry(&e.session).or_insert(k);
            if (k.0, k.1) > (b.0, b.1) {
                *b = k;
            }
        }
        best.values().map(|b| b.2).collect()
    }

    /// Victim order: unprotected first, then least recently used.
    fn victim(&self, filter: impl Fn(&Entry) -> bool) -> Option<(u64, bool)> {
        let protected = self.protected_set();
        self.entries
            .iter()
            .filter(|(_, e)| filter(e))
            .map(|(id, e)| (*id, protected.contains(id), e))
            .min_by(|a, b| {
                (a.1, a.2.last_used, a.2.tick)
                    .partial_cmp(&(b.1, b.2.last_used, b.2.tick))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
            .map(|(id, p, _)| (id, p))
    }

    /// Moves an entry's RAM state down to disk: dropped from RAM at once when its file is
    /// there, else queued on the writer thread (it leaves RAM when written). False when it
    /// cannot go to disk (offload off, or an earlier write of it failed).
    fn demote(&mut self, id: u64) -> bool {
        let Some(dir) = self.disk.clone() else {
            return false;
        };
        let e = &self.entries[&id];
        if e.ram.is_none() || e.writing {
            return true;
        }
        if e.no_disk {
            return false;
        }
        if e.disk.is_some() {
            let e = self.entries.get_mut(&id).unwrap();
            e.ram = None;
            self.ram_use -= e.bytes;
            return true;
        }
        let job = WriteJob {
            id,
            dir,
            identity: self.config.identity.clone(),
            session: e.session.clone(),
            tokens: e.tokens.clone(),
            state: e.ram.clone().unwrap(),
        };
        let w = self.writer.get_or_insert_with(Writer::spawn);
        if w.tx.send(ToWriter::Write(Box::new(job))).is_err() {
            return false;
        }
        let e = self.entries.get_mut(&id).unwrap();
        e.writing = true;
        self.ram_leaving += e.bytes;
        true
    }

    /// Takes the writer thread's finished writes: written entries leave RAM (when disk offload
    /// is still on in the same folder), failed ones stay and are not tried again.
    fn poll_writes(&mut self) {
        let Some(w) = &self.writer else { return };
        let done: Vec<WriteDone> = w.done.try_iter().collect();
        if done.is_empty() {
            return;
        }
        for d in done {
            let Some(e) = self.entries.get_mut(&d.id) else {
                // Removed while it was being written.
                if let Ok((path, _)) = &d.result {
                    let _ = std::fs::remove_file(path);
                }
                continue;
            };
            e.writing = false;
            self.ram_leaving -= e.bytes;
            match d.result {
                Ok((path, n)) if self.disk.as_deref() == Some(d.dir.as_path()) => {
                    e.disk = Some((path, n));
                    e.ram = None;
                    self.ram_use -= e.bytes;
                    self.disk_use += n;
                }
                // Offload was switched off (or moved) meanwhile: the file stays for next time.
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!("prefix cache: moving an entry to disk failed: {err}");
                    e.no_disk = true;
                }
            }
        }
        self.enforce_budgets();
    }

    /// Waits until every queued disk write is done and taken in.
    pub fn wait_writes(&mut self) {
        if let Some(w) = &self.writer {
            let (tx, rx) = mpsc::channel();
            if w.tx.send(ToWriter::Barrier(tx)).is_ok() {
                let _ = rx.recv();
            }
        }
        self.poll_writes();
    }

    /// Disk writes queued and not yet taken in.
    pub fn writes_in_flight(&self) -> usize {
        self.entries.values().filter(|e| e.writing).count()
    }

    /// Tests: from now on every disk write waits for a message on the returned channel
    /// (dropping it lets them all through).
    #[cfg(test)]
    pub(crate) fn gate_writes(&mut self) -> mpsc::Sender<()> {
        let (tx, rx) = mpsc::channel();
        let w = self.writer.get_or_insert_with(Writer::spawn);
        w.tx.send(ToWriter::Gate(rx))
            .expect("the writer thread is running");
        tx
    }

    fn drop_from_ram(&mut self, id: u64) {
        let e = self.entries.get_mut(&id).unwrap();
        if e.disk.is_some() && !e.writing {
            e.ram = None;
            self.ram_use -= e.bytes;
        } else {
            self.remove_entry(id);
        }
    }

    fn enforce_budgets(&mut self) {
        // Entries being written count as gone already.
        while self.ram_use - self.ram_leaving > self.config.ram_bytes {
            let Some((id, _)) = self.victim(|e| e.ram.is_some() && !e.writing) else {
                break;
            };
            // Move down a tier rather than drop (when disk offload is on).
            if !self.demote(id) {
                self.drop_from_ram(id);
            }
        }
        while self.disk_use > self.config.disk_bytes {
            let Some((id, _)) = self.victim(|e| e.disk.is_some()) else {
                break;
            };
            let e = self.entries.get_mut(&id).unwrap();
            let (path, n) = e.disk.take().unwrap();
            let _ = std::fs::remove_file(&path);
            self.disk_use = self.disk_use.saturating_sub(n);
            if e.ram.is_none() {
                self.remove_entry(id);
            }
        }
    }

    /// Moves sessions idle for longer than the configured time to disk (when it is on).
    /// Returns how many entries started moving (their writes finish on the writer thread).
    pub fn maintain(&mut self) -> usize {
        self.poll_writes();
        if self.disk.is_none() {
            return 0;
        }
        let cutoff = unix_now() - self.config.idle.as_secs_f64();
        let idle: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                e.ram.is_some()
                    && !e.writing
                    && !e.no_disk
                    && self
                        .sessions
                        .get(&e.session)
                        .is_some_and(|s| s.last_used < cutoff)
            })
            .map(|(id, _)| *id)
            .collect();
        let mut moved = 0;
        for id in idle {
            if self.demote(id) {
                moved += 1;
            }
        }
        if moved > 0 {
            self.enforce_budgets();
        }
        moved
    }

    /// Writes every session's deepest RAM entry to disk (when disk offload is on), so the
    /// conversations are found again after a restart. Called when the scheduler stops.
    pub fn flush_to_disk(&mut self) -> usize {
        self.poll_writes();
        if self.disk.is_none() {
            return 0;
        }
        let mut written = 0;
        for id in self.protected_set() {
            let e = &self.entries[&id];
            if e.ram.is_some() && e.disk.is_none() && !e.writing && self.demote(id) {
                written += 1;
            }
        }
        self.wait_writes();
        written
    }

    /// True when some session is in RAM and disk offload is on (maintenance has work).
    pub fn has_idle_work(&self) -> bool {
        self.disk.is_some() && self.entries.values().any(|e| e.ram.is_some())
    }

    pub fn ram_use(&self) -> usize {
        self.ram_use
    }

    pub fn disk_use(&self) -> u64 {
        self.disk_use
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Token counts of the entries (tests and diagnostics), with their tier.
    pub fn entries_of(&self, session: &str) -> Vec<(usize, Tier)> {
        let mut v: Vec<(usize, Tier)> = self
            .entries
            .values()
            .filter(|e| e.session == session)
            .map(|e| {
                (
                    e.tokens.len(),
                    if e.ram.is_some() {
                        Tier::Ram
                    } else {
                        Tier::Disk
                    },
                )
            })
            .collect();
        v.sort_by_key(|x| x.0);
        v
    }

    pub fn session_info(&mut self, session: &str) -> Option<&mut SessionInfo> {
        self.sessions.get_mut(session)
    }

    /// Adds a turn's routing heat to the session's: older heat is halved (recent turns
    /// matter more), scores of the same expert add, the hottest [`MAX_HEAT_ENTRIES`] stay.
    pub fn merge_heat(&mut self, session: &str, turn: &[HeatEntry]) {
        if turn.is_empty() {
            return;
        }
        let info = self.sessions.entry(session.to_string()).or_default();
        let mut by: HashMap<(u32, u32), f32> = info
            .expert_heat
            .iter()
            .map(|h| ((h.layer, h.expert), h.score * 0.5))
            .collect();
        for h in turn {
            *by.entry((h.layer, h.expert)).or_default() += h.score;
        }
        let mut v: Vec<HeatEntry> = by
            .into_iter()
            .map(|((layer, expert), score)| HeatEntry {
                layer,
                expert,
                score,
            })
            .collect();
        v.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then((a.layer, a.expert).cmp(&(b.layer, b.expert)))
        });
        v.truncate(MAX_HEAT_ENTRIES);
        info.expert_heat = v;
    }

    /// The session's routing heat (empty when it has none).
    pub fn heat_of(&self, session: &str) -> Vec<HeatEntry> {
        self.sessions
            .get(session)
            .map(|s| s.expert_heat.clone())
            .unwrap_or_default()
    }

    /// One session's line of the status: its parked sequence (tier `vram`, its bytes on the
    /// device added) when it has one, else its deepest entry.
    fn session_status(&self, id: &str, now: f64) -> Option<SessionStatus> {
        let info = self.sessions.get(id);
        let parked = self.parked.get(id);
        let deepest = self.deepest_of(id).map(|d| &self.entries[&d]);
        let mine = self.entries.values().filter(|e| e.session == id);
        let host_bytes: u64 = mine
            .clone()
            .map(|e| {
                e.ram.as_ref().map_or(0, |_| e.bytes as u64) + e.disk.as_ref().map_or(0, |d| d.1)
            })
            .sum();
        let (tier, tokens) = match (parked, deepest) {
            (Some(p), _) => (Tier::Vram, p.tokens),
            (None, Some(d)) if d.ram.is_some() => (Tier::Ram, d.tokens.len()),
            (None, Some(d)) => (Tier::Disk, d.tokens.len()),
            (None, None) => return None,
        };
        Some(SessionStatus {
            id: id.to_string(),
            tier,
            tokens,
            bytes: host_bytes + parked.map_or(0, |p| p.bytes as u64),
            entries: mine.count(),
            last_used_s: info.map_or(0.0, |i| (now - i.last_used).max(0.0)),
            hot_experts: info.map_or(0, |i| i.expert_heat.len()),
        })
    }

    pub fn status(&self) -> CacheStatus {
        let now = unix_now();
        let ids: std::collections::BTreeSet<&String> =
            self.sessions.keys().chain(self.parked.keys()).collect();
        let mut sessions: Vec<SessionStatus> = ids
            .into_iter()
            .filter_map(|id| self.session_status(id, now))
            .collect();
        sessions.sort_by(|a, b| a.last_used_s.total_cmp(&b.last_used_s));
        CacheStatus {
            sessions,
            budgets: Budgets {
                ram_bytes: self.config.ram_bytes as u64,
                disk_bytes: self.config.disk_bytes,
            },
            usage: Budgets {
                ram_bytes: self.ram_use as u64,
                disk_bytes: self.disk_use,
            },
            disk_offload: DiskOffload {
                enabled: self.disk.is_some(),
                dir: self.disk.as_ref().map(|d| {
                    d.parent()
                        .unwrap_or(d.as_path())
                        .to_string_lossy()
                        .into_owned()
                }),
            },
            hits: self.hits,
            misses: self.misses,
            cached_tokens: self.cached_tokens,
            block_tokens: self.config.block_tokens,
            disk_rejected: self.disk_rejected,
        }
    }
}

#[cfg(test)]
mod tests;
