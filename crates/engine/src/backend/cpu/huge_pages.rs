//! Transparent huge pages for the large buffers the CPU streams: the routed-expert store and
//! the bandwidth probe that its kernels are measured against.
//!
//! Why: a decode step reads about ten experts of ~1.9 MB each, picked at random from a store
//! of gigabytes. In 4 KiB pages every expert is ~450 pages, each a TLB miss whose page walk
//! reads page tables that are themselves not in cache; in 2 MiB pages it is one or two.
//! Linux hands out huge pages to anonymous memory marked `MADV_HUGEPAGE` when
//! `/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` (Ubuntu's default) or `always`.
//! `CAPY_HUGE_PAGES=0` leaves the buffers in small pages, to measure the difference.

/// Whether buffers are advised (unless `CAPY_HUGE_PAGES=0`).
pub fn wanted() -> bool {
    std::env::var("CAPY_HUGE_PAGES").map_or(true, |v| v != "0")
}

const HUGE_PAGE: usize = 2 << 20;

/// A zeroed buffer of `len` bytes whose whole 2 MiB pages are advised as huge (where
/// [`wanted`]), before anything touches them: the kernel then backs them with huge pages at
/// the first write.
pub fn zeroed(len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    if wanted() {
        advise(&mut buf);
    }
    buf
}

/// Marks the whole 2 MiB pages inside `buf` `MADV_HUGEPAGE`; false where the OS declined
/// or has no such advice (the buffer works the same, in small pages).
pub fn advise<T>(buf: &mut [T]) -> bool {
    let (start, len) = (buf.as_mut_ptr() as usize, std::mem::size_of_val(buf));
    let first = start.next_multiple_of(HUGE_PAGE);
    let end = (start + len) / HUGE_PAGE * HUGE_PAGE;
    if end <= first {
        return false;
    }
    #[cfg(target_os = "linux")]
    // SAFETY: the range lies inside `buf`, which this process owns; the advice changes only
    // how the kernel backs the pages, not their contents.
    unsafe {
        libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) == 0
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// What the machine and this process have of huge pages, for bench records: the kernel's
/// THP mode (the bracketed word of `transparent_hugepage/enabled`) and the bytes of this
/// process's anonymous memory in huge pages (`AnonHugePages` of `/proc/self/smaps_rollup`).
pub fn status() -> serde_json::Value {
    let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|s| {
            let (_, rest) = s.split_once('[')?;
            Some(rest.split_once(']')?.0.to_string())
        });
    let anon_huge = std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("AnonHugePages:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024);
    serde_json::json!({
        "advised": wanted(),
        "thp_mode": mode,
        "anon_huge_page_bytes": anon_huge,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zeroed_buffer_is_zero_and_of_its_length_whatever_the_advice() {
        for len in [0, 1, 4096, 3 * HUGE_PAGE + 123] {
            let buf = zeroed(len);
            assert_eq!(buf.len(), len);
            assert!(buf.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn a_buffer_without_a_whole_huge_page_is_not_advised() {
        let mut small = vec![0u8; HUGE_PAGE - 1];
        assert!(!advise(&mut small));
    }

    #[test]
    fn the_status_names_the_advice() {
        assert_eq!(status()["advised"], serde_json::json!(wanted()));
    }
}
