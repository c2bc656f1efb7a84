//! [`HostState`]: a sequence's full state copied to host memory, in a layout every tier shares.
//!
//! A model writes its per-sequence state as an ordered list of f32 tensors (KV caches, QSA
//! indexer keys, GDN conv and recurrent states, PLE conv history) and integer lists (the PLE
//! n-gram context), layer by layer; reading it back walks the same order against a fresh
//! state of the same model and checks every shape, so a state from another model or another
//! layout is refused instead of used.

use crate::backend::Backend;
use anyhow::{bail, Result};

/// One f32 tensor `[rows, cols]`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostPart {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// A sequence's state in host memory: `len` tokens, then the model's tensors and id lists in
/// the model's own order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HostState {
    pub len: usize,
    pub tensors: Vec<HostPart>,
    pub ids: Vec<Vec<u32>>,
}

impl HostState {
    pub fn new(len: usize) -> Self {
        HostState {
            len,
            ..Default::default()
        }
    }

    /// Bytes of the tensors and id lists.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len() * 4).sum::<usize>()
            + self.ids.iter().map(|i| i.len() * 4).sum::<usize>()
    }

    /// Appends a copy of a backend activation.
    pub fn push_act<B: Backend>(&mut self, b: &B, a: &B::Act) {
        let (rows, cols) = b.shape(a);
        self.tensors.push(HostPart {
            rows,
            cols,
            data: b.to_host(a),
        });
    }

    pub fn push_ids(&mut self, ids: &[u32]) {
        self.ids.push(ids.to_vec());
    }

    pub fn reader(&self) -> HostReader<'_> {
        HostReader {
            state: self,
            tensor: 0,
            ids: 0,
        }
    }
}

/// Spare rows given to a growing tensor restored with `rows` rows: a quarter more, at least 256
/// (a turn of an agent adds a tool result and an answer, rarely more).
pub fn growth_rows(rows: usize) -> usize {
    (rows / 4).max(256)
}

/// Reads a [`HostState`] back in the order it was written, checking shapes.
pub struct HostReader<'a> {
    state: &'a HostState,
    tensor: usize,
    ids: usize,
}

impl HostReader<'_> {
    /// The next tensor as an activation shaped like `template` (same columns; `rows` rows when
    /// given, else any).
    pub fn act<B: Backend>(
        &mut self,
        b: &B,
        template: &B::Act,
        rows: Option<usize>,
        what: &str,
    ) -> Result<B::Act> {
        let p = self.next_part(b, template, rows, what)?;
        Ok(b.from_host(p.rows, p.cols, &p.data))
    }

    /// Like [`Self::act`], for a tensor that grows a row per token (KV caches, indexer keys):
    /// it gets room for [`growth_rows`] more rows, so the turn that resumes it appends in place
    /// instead of copying the whole cache into a buffer twice its size.
    pub fn growing<B: Backend>(
        &mut self,
        b: &B,
        template: &B::Act,
        rows: Option<usize>,
        what: &str,
    ) -> Result<B::Act> {
        let p = self.next_part(b, template, rows, what)?;
        Ok(b.from_host_with_capacity(p.rows, p.cols, p.rows + growth_rows(p.rows), &p.data))
    }

    fn next_part<B: Backend>(
        &mut self,
        b: &B,
        template: &B::Act,
        rows: Option<usize>,
        what: &str,
    ) -> Result<&HostPart> {
        let Some(p) = self.state.tensors.get(self.tensor) else {
            bail!(
                "the cached state ends before {what} (tensor {}): it was written by another model",
                self.tensor
            );
        };
        let (_, cols) = b.shape(template);
        if p.cols != cols || rows.is_some_and(|r| r != p.rows) || p.data.len() != p.rows * p.cols {
            bail!(
                "cached state tensor {} ({what}) is [{}, {}]; this model expects [{}, {cols}]: it was written by another model or layout",
                self.tensor,
                p.rows,
                p.cols,
                rows.map_or("any".to_string(), |r| r.to_string()),
            );
        }
        self.tensor += 1;
        Ok(p)
    }

    /// The next id list, of `len` ids.
    pub fn ids(&mut self, len: usize, what: &str) -> Result<Vec<u32>> {
        let Some(ids) = self.state.ids.get(self.ids) else {
            bail!("the cached state ends before {what}: it was written by another model");
        };
        if ids.len() != len {
            bail!(
                "cached {what} has {} ids; this model expects {len}",
                ids.len()
            );
        }
        self.ids += 1;
        Ok(ids.clone())
    }

    /// Fails unless everything was read.
    pub fn finish(self) -> Result<()> {
        if self.tensor != self.state.tensors.len() || self.ids != self.state.ids.len() {
            bail!(
                "the cached state has {} tensors and {} id lists; this model read {} and {}: it was written by another model",
                self.state.tensors.len(),
                self.state.ids.len(),
                self.tensor,
                self.ids
            );
        }
        Ok(())
    }
}

use crate::model::layers::attention::AttentionState;
use crate::model::layers::gdn::LinearState;
use crate::model::layers::ple::PleState;

/// Writes an attention layer's state: K, V, then the QSA indexer's raw and block keys.
pub fn write_attention<B: Backend>(out: &mut HostState, b: &B, a: &AttentionState<B>) {
    out.push_act(b, &a.k);
    out.push_act(b, &a.v);
    if let Some((raw, blocks)) = &a.index {
        out.push_act(b, raw);
        out.push_act(b, blocks);
    }
}

/// Reads what [`write_attention`] wrote, shaped like `template` (a fresh state).
pub fn read_attention<B: Backend>(
    r: &mut HostReader<'_>,
    b: &B,
    template: &AttentionState<B>,
    len: usize,
) -> Result<AttentionState<B>> {
    Ok(AttentionState {
        k: r.growing(b, &template.k, Some(len), "attention keys")?,
        v: r.growing(b, &template.v, Some(len), "attention values")?,
        index: match &template.index {
            Some((raw, blocks)) => Some((
                r.growing(b, raw, None, "QSA indexer keys")?,
                r.growing(b, blocks, None, "QSA block keys")?,
            )),
            None => None,
        },
    })
}

/// Writes a GDN layer's conv and recurrent states.
pub fn write_linear<B: Backend>(out: &mut HostState, b: &B, l: &LinearState<B>) {
    out.push_act(b, &l.conv);
    out.push_act(b, &l.recurrent);
}

pub fn read_linear<B: Backend>(
    r: &mut HostReader<'_>,
    b: &B,
    template: &LinearState<B>,
) -> Result<LinearState<B>> {
    let rows = |a: &B::Act| Some(b.shape(a).0);
    Ok(LinearState {
        conv: r.act(b, &template.conv, rows(&template.conv), "GDN conv state")?,
        recurrent: r.act(
            b,
            &template.recurrent,
            rows(&template.recurrent),
            "GDN recurrent state",
        )?,
    })
}

/// Writes a PLE layer's n-gram context and conv history.
pub fn write_ple<B: Backend>(out: &mut HostState, b: &B, p: &PleState<B>) {
    out.push_ids(&p.context);
    out.push_act(b, &p.conv);
}

pub fn read_ple<B: Backend>(
    r: &mut HostReader<'_>,
    b: &B,
    template: &PleState<B>,
) -> Result<PleState<B>> {
    Ok(PleState {
        context: r.ids(template.context.len(), "PLE n-gram context")?,
        conv: r.act(
            b,
            &template.conv,
            Some(b.shape(&template.conv).0),
            "PLE conv history",
        )?,
    })
}
