//! Splitting a batch's routing between resident (GPU) and host (CPU) experts.
//!
//! Each side gets a [`MoeRouting`] of its own with `top_k` = the most pairs any row has on that
//! side. Rows with fewer pairs are padded with weight-0 pairs that point at an expert the side
//! already computes (the row's own, else the side's first), so padding never reads an extra
//! expert's weights. The two sides' outputs add up to the unsplit result.

use crate::backend::MoeRouting;

/// The resident and host halves of a routing; `None` where a side has no pairs.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitRouting {
    pub resident: Option<MoeRouting>,
    pub host: Option<MoeRouting>,
}

/// Splits `routing` by `is_resident(expert)`.
pub fn split_routing(routing: &MoeRouting, is_resident: impl Fn(u32) -> bool) -> SplitRouting {
    let k = routing.top_k;
    let rows = routing.experts.len().checked_div(k).unwrap_or(0);
    let mut sides: [Vec<Vec<(u32, f32)>>; 2] = [vec![Vec::new(); rows], vec![Vec::new(); rows]];
    let chosen = routing
        .experts
        .chunks(k.max(1))
        .zip(routing.weights.chunks(k.max(1)));
    for (r, (experts, weights)) in chosen.take(rows).enumerate() {
        for (&e, &w) in experts.iter().zip(weights) {
            let side = usize::from(!is_resident(e));
            sides[side][r].push((e, w));
        }
    }
    let [resident, host] = sides.map(pack);
    SplitRouting { resident, host }
}

fn pack(rows: Vec<Vec<(u32, f32)>>) -> Option<MoeRouting> {
    let top_k = rows.iter().map(Vec::len).max().unwrap_or(0);
    if top_k == 0 {
        return None;
    }
    let first = rows.iter().find_map(|r| r.first()).map(|&(e, _)| e)?;
    let mut experts = Vec::with_capacity(rows.len() * top_k);
    let mut weights = Vec::with_capacity(rows.len() * top_k);
    for r in &rows {
        let filler = r.first().map_or(first, |&(e, _)| e);
        for j in 0..top_k {
            let (e, w) = r.get(j).copied().unwrap_or((filler, 0.0));
            experts.push(e);
            weights.push(w);
        }
    }
    Some(MoeRouting {
        top_k,
        experts,
        weights,
    })
}

/// Distinct experts of a routing, in increasing order.
pub fn distinct_experts(routing: &MoeRouting) -> Vec<u32> {
    let mut v = routing.experts.clone();
    v.sort_unstable();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(top_k: usize, pairs: &[(u32, f32)]) -> MoeRouting {
        MoeRouting {
            top_k,
            experts: pairs.iter().map(|p| p.0).collect(),
            weights: pairs.iter().map(|p| p.1).collect(),
        }
    }

    #[test]
    fn splits_and_pads_with_experts_already_read() {
        // Row 0: experts 1 (resident), 4, 6; row 1: 2 (resident), 3 (resident), 4.
        let r = routing(
            3,
            &[(1, 0.5), (4, 0.3), (6, 0.2), (2, 0.6), (3, 0.3), (4, 0.1)],
        );
        let s = split_routing(&r, |e| e < 4);
        assert_eq!(
            s.resident.unwrap(),
            routing(2, &[(1, 0.5), (1, 0.0), (2, 0.6), (3, 0.3)])
        );
        assert_eq!(
            s.host.unwrap(),
            routing(2, &[(4, 0.3), (6, 0.2), (4, 0.1), (4, 0.0)])
        );
    }

    #[test]
    fn a_row_with_nothing_on_a_side_borrows_the_sides_first_expert() {
        let r = routing(2, &[(7, 0.9), (8, 0.1), (1, 0.5), (2, 0.5)]);
        let s = split_routing(&r, |e| e < 4);
        assert_eq!(
            s.resident.unwrap(),
            routing(2, &[(1, 0.0), (1, 0.0), (1, 0.5), (2, 0.5)])
        );
        assert_eq!(distinct_experts(&s.host.unwrap()), vec![7, 8]);
    }

    #[test]
    fn one_sided_routings_leave_the_other_side_empty() {
        let r = routing(2, &[(1, 0.5), (2, 0.5)]);
        let all = split_routing(&r, |_| true);
        assert_eq!(all.resident.as_ref(), Some(&r));
        assert!(all.host.is_none());
        let none = split_routing(&r, |_| false);
        assert!(none.resident.is_none());
        assert_eq!(none.host.as_ref(), Some(&r));
    }
}
