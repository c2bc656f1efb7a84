//! CUDA kernels run on the CPU, without a GPU: `cuda_emulated/emu.hpp` emulates blocks,
//! barriers, warp shuffles and shared memory with one OS thread per CUDA thread, and a C++
//! driver per kernel file launches the kernels as the backend does (the launch plan comes from
//! the engine itself) and checks them against a double-precision reference. Built with
//! AddressSanitizer and UBSan: a kernel that reads past the shared memory the host reserves,
//! past a buffer, or loads a misaligned float4 fails here, as it would on the card (or worse,
//! silently). What it cannot show is speed or a GPU-only race; the GPU suites cover those.
//!
//! Needs a C++20 compiler (`CXX`, else `c++`); without one the tests print why and pass,
//! except under `CI=true`, where the compiler is installed and a skip would hide a failure.
#![cfg(feature = "cuda")]

use capy_engine::backend::cuda::flash_next::{
    decode_q8_down_plan, decode_q8_gate_up_plan, moe_prefill_plan,
};
use capy_engine::backend::cuda::{norm_split_plan, norm_threads, ChunkedDeltaRulePlan};
use capy_engine::backend::DeltaRuleShape;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `files` named in place of a kernel file: the backend's generated quantized-weight tables
/// (`QT_IQ3S` and the others), as NVRTC compiles them before kernels/quant_matvec.cu.
const QUANT_TABLES: &str = "<quant tables>";

/// kernels/common.cuh and `files` rewritten for the emulator: inline PTX aborts, dynamic shared
/// memory is the launch's buffer, static shared arrays are statics (one block at a time).
fn emulator_source(files: &[&str]) -> String {
    let read = |p: &str| {
        if p == QUANT_TABLES {
            return capy_engine::backend::cuda::kernels::quant_tables();
        }
        std::fs::read_to_string(repo_root().join(p)).unwrap_or_else(|e| panic!("reading {p}: {e}"))
    };
    let file = files.join(", ");
    let src = files
        .iter()
        .fold(read("kernels/common.cuh"), |acc, f| acc + &read(f));
    let mut out = String::with_capacity(src.len());
    for line in src
        .replace("asm volatile(", "EMU_ASM(")
        .replace("asm(", "EMU_ASM(")
        .lines()
    {
        // `extern __shared__ T name[];` → `T* name = emu::dynamic_smem<T>();`
        let t = line.split("//").next().unwrap_or("").trim();
        if let Some(decl) = t
            .strip_prefix("extern __shared__ ")
            .and_then(|d| d.strip_suffix("[];"))
        {
            // The dynamic buffer is allocated aligned: an alignment attribute has no place here.
            let decl = match decl.strip_prefix("__align__(") {
                Some(rest) => rest.split_once(") ").map_or(decl, |(_, d)| d),
                None => decl,
            };
            let (ty, name) = decl
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("{file}: unexpected shared declaration `{t}`"));
            out.push_str(&format!("{ty}* {name} = emu::dynamic_smem<{ty}>();\n"));
        } else {
            out.push_str(&line.replace("__shared__", "static"));
            out.push('\n');
        }
    }
    out
}

/// The C++ compiler, or why there is none.
fn cxx() -> Result<String, String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    match Command::new(&cxx).arg("--version").output() {
        Ok(o) if o.status.success() => Ok(cxx),
        _ => Err(format!(
            "no C++ compiler `{cxx}` (set CXX, or apt-get install g++)"
        )),
    }
}

/// Builds `cuda_emulated/<driver>.cpp` with `kernel_files` (after kernels/common.cuh).
fn build(driver: &str, kernel_files: &[&str]) -> Option<PathBuf> {
    let cxx = match cxx() {
        Ok(c) => c,
        Err(why) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but {why}")
        }
        Err(why) => {
            println!("skipping: {why}");
            return None;
        }
    };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("cuda-emulation")
        .join(driver);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kernels.inc"), emulator_source(kernel_files)).unwrap();
    let exe = dir.join(driver);
    let src_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_emulated");
    let out = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O1",
            "-g",
            "-pthread",
            "-Wno-unknown-pragmas",
        ])
        .args([
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=undefined",
        ])
        .arg(format!("-I{}", dir.display()))
        .arg(format!("-I{}", src_dir.display()))
        .arg(src_dir.join(format!("{driver}.cpp")))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("running the C++ compiler");
    assert!(
        out.status.success(),
        "compiling the emulated {kernel_files:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}

/// `fn $fn() -> Option<&'static Path>`: the emulator driver `cuda_emulated/$driver.cpp` with
/// `$files` (after kernels/common.cuh), built once per test run (None where there is no C++
/// compiler).
macro_rules! driver {
    ($fn:ident, $driver:literal, [$($file:literal),* $(,)?]) => {
        fn $fn() -> Option<&'static Path> {
            static EXE: OnceLock<Option<PathBuf>> = OnceLock::new();
            EXE.get_or_init(|| build($driver, &[$($file),*])).as_deref()
        }
    };
}

driver!(delta_rule_driver, "delta_rule", ["kernels/delta_rule.cu"]);

driver!(norm_driver, "norm", ["kernels/norm.cu", "kernels/hyper.cu"]);

driver!(norm_split_driver, "norm_split", ["kernels/norm.cu"]);

driver!(
    attention_inputs_driver,
    "attention_inputs",
    ["kernels/norm.cu"]
);

driver!(moe_route_driver, "moe_route", ["kernels/moe.cu"]);

driver!(qsa_select_driver, "qsa_select", ["kernels/qsa.cu"]);

driver!(
    qsa_attention_driver,
    "qsa_attention",
    ["kernels/attention.cu", "kernels/qsa.cu"]
);

driver!(attention_driver, "attention", ["kernels/attention.cu"]);

driver!(
    qsa_mask_driver,
    "qsa_mask",
    ["kernels/attention.cu", "kernels/qsa.cu"]
);

driver!(sampling_driver, "sampling", ["kernels/sampling.cu"]);

driver!(
    moe_quant_decode_driver,
    "moe_quant_decode",
    ["<quant tables>", "kernels/moe_quant_decode.cu"]
);

driver!(
    moe_decode_q8_driver,
    "moe_decode_q8",
    ["<quant tables>", "kernels/moe_quant_decode.cu"]
);

driver!(
    moe_prefill_driver,
    "moe_prefill",
    [
        "<quant tables>",
        "kernels/quant_matvec.cu",
        "kernels/moe_quant.cu",
        "kernels/moe_quant_decode.cu",
        "kernels/moe_prefill.cu"
    ]
);

driver!(
    iq3s_records_driver,
    "iq3s_records",
    ["<quant tables>", "kernels/quant_matvec.cu"]
);

driver!(
    conversions_driver,
    "conversions",
    ["kernels/elementwise.cu", "kernels/moe.cu"]
);

/// Runs `driver` with `args`; fails with its output unless it exits 0 having printed `checks`
/// lines ending in `ok`.
fn run_driver(exe: &Path, args: &[usize], checks: usize, what: &str) {
    run_driver_with(exe, &[], args, checks, what);
}

/// [`run_driver`] with words before the numeric arguments (a format's name, a kernel's, files).
fn run_driver_with(
    exe: &Path,
    words: &[&str],
    args: &[usize],
    checks: usize,
    what: &str,
) -> String {
    let out = Command::new(exe)
        .args(words)
        .args(args.iter().map(|a| a.to_string()))
        .output()
        .expect("running the emulated kernels");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(
        out.status.success(),
        "{what} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        text.matches(": ok").count(),
        checks,
        "expected {checks} checks of {what}: {text}"
    );
    text.into_owned()
}

/// Runs the chunked kernels over `n` tokens of shape `s` with the backend's launch plan (the
/// workspace bounded to `workspace_bytes`, to force segments), and the recurrent kernel.
fn check_delta_rule(n: usize, s: DeltaRuleShape, workspace_bytes: usize, min_segments: usize) {
    let Some(exe) = delta_rule_driver() else {
        return;
    };
    let plan = ChunkedDeltaRulePlan::with_workspace(n, s, workspace_bytes);
    let segments = plan.chunks.div_ceil(plan.seg_chunks);
    assert!(
        segments >= min_segments,
        "the test wants {min_segments} segments, the plan has {segments}: {plan:?}"
    );
    let args = [
        n,
        s.num_k_heads,
        s.num_v_heads,
        s.k_head_dim,
        s.v_head_dim,
        plan.seg_chunks,
        plan.per_chunk_floats,
        plan.prep_smem,
        plan.scan_smem,
        ChunkedDeltaRulePlan::TILE,
        7,
    ];
    run_driver(
        exe,
        &args,
        4,
        &format!("the emulated delta rule for n={n} {s:?} ({plan:?})"),
    );
}

#[test]
fn chunked_delta_rule_at_the_27b_head_size_over_two_segments() {
    // 128-wide heads as in both checkpoints, two value heads per key head, a partial last
    // chunk (150 = 2·64 + 22), and a workspace of two chunks: two segments.
    let s = DeltaRuleShape {
        num_k_heads: 2,
        num_v_heads: 4,
        k_head_dim: 128,
        v_head_dim: 128,
    };
    let per_chunk = ChunkedDeltaRulePlan::new(1, s).per_chunk_floats;
    check_delta_rule(150, s, 2 * per_chunk * 4 * 4, 2);
}

#[test]
fn chunked_delta_rule_with_a_partial_value_tile_and_small_heads() {
    // dv = 48: the second 32-column tile is half empty; dk = 64 leaves the staging vectors
    // partly unused.
    let s = DeltaRuleShape {
        num_k_heads: 1,
        num_v_heads: 2,
        k_head_dim: 64,
        v_head_dim: 48,
    };
    check_delta_rule(70, s, usize::MAX, 1);
}

#[test]
fn chunked_delta_rule_at_the_fixture_head_size() {
    let s = DeltaRuleShape {
        num_k_heads: 2,
        num_v_heads: 2,
        k_head_dim: 32,
        v_head_dim: 32,
    };
    check_delta_rule(130, s, usize::MAX, 1);
}

#[test]
fn the_emulator_rewrites_every_shared_declaration() {
    let src = emulator_source(&[
        "kernels/delta_rule.cu",
        "kernels/norm.cu",
        "kernels/moe.cu",
        "kernels/qsa.cu",
    ]);
    assert!(!src.contains("__shared__"), "a shared declaration was left");
    assert!(src.contains("float* sm = emu::dynamic_smem<float>();"));
    assert!(!src.contains("asm(") && !src.contains("asm volatile("));
}

#[test]
fn the_fused_wide_norm_and_the_warp_norm_equal_their_plain_forms_bit_for_bit() {
    // Flash-Next's hyper-connection norms: 4 streams of 2560, one row (decode) and three
    // (prefill); and a group above the register path's 8192 values (the looping path).
    let Some(exe) = norm_driver() else {
        return;
    };
    for (rows, streams, group) in [(1, 4, 2560), (3, 4, 2560), (1, 2, 9216)] {
        run_driver(
            exe,
            &[rows, streams, group, norm_threads(group), 5],
            4,
            &format!("the emulated wide norm ({rows} rows, {streams} streams of {group})"),
        );
    }
}

#[test]
fn the_split_norm_meets_at_its_barrier_and_equals_the_one_block_norm() {
    // The 27B's 5120-value residual rows (10 blocks), Flash-Next's 2560 (5), and a row whose
    // last block is partly empty (1056 = 2 full warps past 1024); with and without the add.
    let Some(exe) = norm_split_driver() else {
        return;
    };
    for (group, add) in [(5120, 1), (2560, 1), (1056, 1), (5120, 0)] {
        let (blocks, threads) = norm_split_plan(group).expect("a wide row splits");
        assert!(blocks > 1, "{group} values gave one block");
        run_driver(
            exe,
            &[group, threads, add, 7],
            5,
            &format!("the emulated split norm ({group} values over {blocks} blocks, add {add})"),
        );
    }
    assert_eq!(
        norm_split_plan(1024),
        None,
        "a 1024-value row loads in one round on one SM"
    );
    assert_eq!(norm_split_plan(5000), None, "not whole int8 groups");
}

#[test]
fn fused_attention_inputs_equal_the_five_launches_they_replace() {
    // The 27B's attention (24 heads, 4 KV heads of 256, a quarter rotated) and a small one
    // with odd head counts; the launch shape is the backend's (a head a block, then copiers).
    let Some(exe) = attention_inputs_driver() else {
        return;
    };
    for (heads, kv_heads, d, rotary) in [(24usize, 4, 256usize, 64), (3, 1, 64, 64)] {
        let threads = d.div_ceil(32).clamp(1, 8) * 32;
        let copiers = (heads * d + kv_heads * d).div_ceil(threads * 4).max(1);
        run_driver(
            exe,
            &[heads, kv_heads, d, rotary, threads, copiers, 3],
            4,
            &format!("the emulated attention inputs ({heads} heads, {kv_heads} KV heads of {d})"),
        );
    }
}

#[test]
fn moe_routing_picks_the_stable_top_k_with_ties_at_the_top() {
    // Flash-Next's 512 experts, top 10, both with and without renormalising; a small router
    // (fewer experts than lanes); rows with exact ties at the top.
    let Some(exe) = moe_route_driver() else {
        return;
    };
    for (rows, experts, k, normalize) in [(3, 512, 10, 1), (2, 512, 10, 0), (2, 20, 4, 1)] {
        run_driver(
            exe,
            &[rows, experts, k, normalize, 11],
            3,
            &format!(
                "the emulated routing ({rows} rows, top {k} of {experts}, normalize {normalize})"
            ),
        );
    }
}

#[test]
fn qsa_selects_the_stable_top_blocks_then_the_tail() {
    // Flash-Next's block budget (512 blocks of 4 tokens) at ~8K context, queries on both sides
    // of the point where blocks outnumber the budget, and a small budget over many blocks
    // (several blocks a thread).
    let Some(exe) = qsa_select_driver() else {
        return;
    };
    // The block scores at Flash-Next's indexer (4 heads of 128), several query tiles with a
    // partial one, and a head size off the staging's 32.
    for (rows, past, topk, ratio, heads, d) in [
        (4, 8190, 512, 4, 4, 128),
        (6, 2048, 512, 4, 4, 32),
        (3, 3000, 7, 2, 3, 20),
        (70, 300, 16, 4, 2, 40),
    ] {
        run_driver(
            exe,
            &[rows, past, topk, ratio, 3, heads, d],
            3,
            &format!("the emulated QSA selection and block scores ({rows} queries after {past}, top {topk} blocks of {ratio}, {heads} heads of {d})"),
        );
    }
}

#[test]
fn qsa_attention_over_token_lists_matches_the_softmax_reference() {
    // Flash-Next's heads (24 query heads on 2 KV heads of 256) over lists split in parts of 128
    // (the host's QSA_SPLIT: 32 keys a warp, one prefetch batch), and a short split with
    // several batches a warp and ragged ends.
    let Some(exe) = qsa_attention_driver() else {
        return;
    };
    for (rows, tokens, heads, kv_heads, d, split) in
        [(2, 300, 24, 2, 256, 128), (3, 200, 4, 2, 64, 200)]
    {
        run_driver(
            exe,
            &[rows, tokens, heads, kv_heads, d, split, 9],
            1,
            &format!("the emulated QSA attention ({rows} queries, {tokens} tokens, split {split})"),
        );
    }
}

#[test]
fn decode_attention_matches_the_causal_softmax_reference() {
    // The 27B's full-attention layers (24 query heads on 4 KV heads of 256: 6 a block) over
    // splits of 64 keys, with the last split partial; a group of 8 (two blocks a KV head, the
    // second with 2 heads); and two query rows (speculative or batched decode: causal). Each
    // also with the output gate in the combine, and one row's int8 copy.
    let Some(exe) = attention_driver() else {
        return;
    };
    for (rows, past, heads, kv_heads, d, split) in [
        (1, 300, 24, 4, 256, 64),
        (2, 150, 16, 2, 128, 64),
        (1, 40, 4, 4, 64, 128),
    ] {
        run_driver(
            exe,
            &[rows, past, heads, kv_heads, d, split, 13],
            if rows == 1 { 3 } else { 2 },
            &format!("the emulated decode attention ({rows} rows after {past}, {heads}/{kv_heads} heads of {d})"),
        );
    }
}

/// The prefill's elementwise passes: the vectorized `f32_to_bf16_kernel` at aligned and
/// unaligned operands with a tail, the grouped experts' gather and SwiGLU into BF16 against the
/// f32 kernels they replace, and `split_cols4` / `silu_mul_halves` four values a thread and one
/// (cuda_emulated/conversions.cpp).
#[test]
fn prefill_elementwise_kernels_match_their_scalar_forms() {
    let Some(exe) = conversions_driver() else {
        return;
    };
    for (n, rows, cols) in [
        (0usize, 1usize, 8usize),
        (1, 3, 40),
        (1031, 5, 96),
        (4096, 17, 64),
    ] {
        run_driver(
            exe,
            &[n, rows, cols, 3],
            13,
            &format!("the emulated BF16 conversions (n={n}, {rows}x{cols})"),
        );
    }
}

/// QSA prefill's masked dense attention: token lists as `qsa_select` writes them become block
/// masks, and the masked softmax weighs exactly the listed tokens (cuda_emulated/qsa_mask.cpp).
#[test]
fn qsa_token_masks_restrict_the_softmax_to_the_listed_tokens() {
    let Some(exe) = qsa_mask_driver() else {
        return;
    };
    // (rows, past, ratio, topk): rows within and past the budget, a mask wider than one word;
    // ratios that are powers of two (the mask's block found by a shift) and one that is not.
    for (rows, past, ratio, topk) in [
        (20usize, 30usize, 4usize, 3usize),
        (33, 600, 4, 40),
        (5, 1, 2, 1),
        (9, 200, 3, 12),
    ] {
        run_driver(
            exe,
            &[rows, past, ratio, topk, 5],
            2,
            &format!("the emulated QSA token mask ({rows} queries after {past}, blocks of {ratio}, top {topk})"),
        );
    }
}

#[test]
fn device_argmax_picks_as_the_host_does() {
    // Parts of the backend's size (ARGMAX_CHUNK, the last one partial), limited to fewer ids
    // than the row holds and not; a row shorter than one part; parts smaller than a block.
    // (Ten parts, not the vocabulary's 122: the emulator runs an OS thread per CUDA thread.)
    let Some(exe) = sampling_driver() else {
        return;
    };
    for (cols, limit, chunk) in [
        (20_000, 19_990, 2048),
        (20_000, 20_000, 2048),
        (1000, 999, 2048),
        (3000, 2900, 100),
    ] {
        run_driver(
            exe,
            &[cols, limit, chunk, 5],
            5,
            &format!("the emulated argmax ({limit} of {cols} values, parts of {chunk})"),
        );
    }
}

/// The decode step's grouped IQ3_S gate/up kernel (cuda_emulated/moe_quant_decode.cpp)
/// against a double reference that dequantizes weight by weight: at Flash-Next's sizes
/// (hidden 2560, intermediate 640: five steps a lane) with interleaved gate/up rows, and on a
/// smaller shape with the rows in halves, where the steps do not divide evenly among the lanes.
#[test]
fn decode_gate_up_kernel_matches_the_dequantized_reference() {
    let Some(exe) = moe_quant_decode_driver() else {
        return;
    };
    for (groups, hidden, inter, interleaved) in [(2, 2560, 640, 1), (3, 768, 192, 0)] {
        run_driver(
            exe,
            &[groups, hidden, inter, interleaved, 11],
            1,
            &format!("the emulated decode gate/up ({groups} groups, {hidden} x {inter})"),
        );
    }
}

/// The fast path's grouped decode experts (cuda_emulated/moe_decode_q8.cpp): IQ3_S gate/up
/// with Q2_0 down (Flash-Next's GGUF experts) and the NVFP4 pair, launched as the engine plans
/// them, against the same int8 rounding of x done in double (f32 rounding apart, equal) and
/// against unrounded x (within the rounding's bound): at Flash-Next's sizes with gate/up rows
/// in halves (the device routing's layout) and on a smaller shape with them interleaved (the
/// hybrid cache's host records).
#[test]
fn decode_q8_experts_match_the_rounded_and_the_exact_reference() {
    use capy_engine::backend::cpu::experts::RowFormat;
    use capy_engine::quant::GgmlType;
    let Some(exe) = moe_decode_q8_driver() else {
        return;
    };
    let pairs = [
        (
            "iq3s",
            RowFormat::Ggml(GgmlType::Iq3S),
            RowFormat::Ggml(GgmlType::Q2_0),
        ),
        ("nvfp4", RowFormat::Nvfp4, RowFormat::Nvfp4),
    ];
    for (name, gate_up, down) in pairs {
        for (groups, hidden, inter, interleaved) in [(2, 2560, 640, 0), (3, 1024, 192, 1)] {
            let gu = decode_q8_gate_up_plan(gate_up, hidden, inter)
                .unwrap_or_else(|| panic!("no {name} gate/up plan for {hidden} x {inter}"));
            let dn = decode_q8_down_plan(down, hidden, inter)
                .unwrap_or_else(|| panic!("no {name} down plan for {hidden} x {inter}"));
            run_driver_with(
                exe,
                &[name],
                &[
                    groups,
                    hidden,
                    inter,
                    interleaved,
                    17,
                    gu.blocks,
                    gu.smem,
                    dn.blocks,
                    dn.smem,
                ],
                4,
                &format!(
                    "the emulated {name} q8 decode experts ({groups} groups, {hidden} x {inter})"
                ),
            );
        }
    }
}

/// Prefill's routed experts on the device (cuda_emulated/moe_prefill.cpp), launched as the
/// engine plans them: the sort by expert into padded blocks, the IQ3_S and Q2_0 32-weight unit
/// decode against the 8-weight groups' bit for bit, and the tensor-core gate/up and
/// down kernels reading quantized weights, against double sums, for IQ3_S gate/up with Q2_0
/// down, for NVFP4 and for Q8_0. Shapes with partial tiles (intermediate columns past a CTA's
/// 128; with Q8_0's 32-weight blocks, k-steps past the last column), gate/up rows
/// interleaved, and a skewed routing that gives some experts several blocks and some none.
/// Each case runs as planned for an sm_90 SM (two input buffers, the next k-step's inputs in
/// flight) and for a 100 KiB one (sm_120: one buffer).
#[test]
fn prefill_experts_on_tensor_cores_match_double_sums() {
    let Some(exe) = moe_prefill_driver() else {
        return;
    };
    // Blocks seen over the cases: with several blocks an expert, full, filled past half, and
    // within half (where the second half's warps skip their products).
    let mut fills = [0usize; 4];
    let mut buffers_seen = vec![];
    for ((name, rows, experts, k, hidden, inter, interleaved), smem_per_sm) in [
        ("iq3s", 150, 4, 2, 256, 192, 0),
        ("nvfp4", 70, 6, 3, 128, 192, 1),
        ("q8_0", 30, 12, 2, 96, 96, 0),
    ]
    .into_iter()
    .flat_map(|case| [(case, 233_472), (case, 102_400)])
    {
        let plan = moe_prefill_plan(rows, k, experts, hidden, inter, smem_per_sm);
        buffers_seen.push(plan.input_buffers);
        let text = run_driver_with(
            exe,
            &[name],
            &[
                rows,
                experts,
                k,
                hidden,
                inter,
                interleaved,
                23,
                plan.max_blocks,
                plan.gate_up_blocks,
                plan.down_blocks,
                plan.input_buffers,
                plan.smem,
            ],
            // IQ3_S/Q2_0 add the unit decode's check.
            if name == "iq3s" { 4 } else { 3 },
            &format!(
                "the emulated {name} prefill experts ({rows} rows, top {k} of {experts}, {} input \
                 buffers)",
                plan.input_buffers
            ),
        );
        let numbers: Vec<usize> = text
            .lines()
            .find(|l| l.starts_with("moe_prefill_align:"))
            .expect("the align kernel's line")
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|w| w.parse().ok())
            .collect();
        // blocks, experts with several, experts with none, full, past half, within half
        let [_, several, _, full, past_half, within_half] = numbers[..] else {
            panic!("unexpected align line in {text}")
        };
        for (f, v) in fills
            .iter_mut()
            .zip([several, full, past_half, within_half])
        {
            *f += v;
        }
    }
    assert_eq!(buffers_seen, [2, 1, 2, 1, 2, 1]);
    assert!(
        fills.iter().all(|&f| f > 0),
        "the cases should cover experts with several blocks and full, past-half and within-half \
         blocks; they made {fills:?}"
    );
}

/// The IQ3_S records matvecs (cuda_emulated/iq3s_records.cpp): every variant (plain, as
/// planned, every split-K a shape allows) launched as the backend plans it
/// (`iq3sr_launch_plan`; 4 SMs, so that the plan splits small matrices), on records of the
/// engine's own repack, against the same int8 rounding done in double. Shapes: rows not a
/// multiple of a block's 32 rows (nor of 2), 1, 2 and 5 records a row.
#[test]
fn iq3s_records_matvecs_match_the_rounded_reference() {
    use capy_engine::backend::cpu::experts::{random_blocks, RowFormat};
    use capy_engine::backend::cuda::iq3s_records::to_records;
    use capy_engine::backend::cuda::{iq3sr_launch_plan, RecordsKernel, IQ3SR_SPLITK};
    use capy_engine::quant::GgmlType;
    let Some(exe) = iq3s_records_driver() else {
        return;
    };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-emulation/iq3s_records");
    for (rows, cols) in [(70, 2048), (37, 5120), (45, 1024)] {
        let blocks = random_blocks(
            RowFormat::Ggml(GgmlType::Iq3S),
            rows * cols / 256,
            (rows * cols) as u64,
        );
        let (blocks_file, records_file) = (
            dir.join(format!("blocks-{rows}x{cols}")),
            dir.join(format!("records-{rows}x{cols}")),
        );
        std::fs::write(&blocks_file, &blocks).unwrap();
        std::fs::write(&records_file, to_records(&blocks, cols)).unwrap();
        let forced = [RecordsKernel::Plain, RecordsKernel::Auto]
            .into_iter()
            .chain(
                IQ3SR_SPLITK
                    .into_iter()
                    .filter(|k| cols / 1024 >= k.ks)
                    .map(RecordsKernel::SplitK),
            );
        for kernel in forced {
            let (name, launch_blocks) = iq3sr_launch_plan(rows, cols, 4, kernel);
            run_driver_with(
                exe,
                &[
                    name,
                    blocks_file.to_str().unwrap(),
                    records_file.to_str().unwrap(),
                ],
                &[rows, cols, launch_blocks, rows + cols],
                1,
                &format!("the emulated {name} ({rows} x {cols}, {kernel:?})"),
            );
        }
    }
}
