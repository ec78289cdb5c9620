//! The first 2 MiB of the binary's code moved onto one transparent huge page.
//!
//! The gateway's per-request functions are linked side by side at the start of `.text`
//! (`build.rs`, `hot-symbols.txt`), and the code segment starts on a 2 MiB boundary
//! (`-z separate-code` with a 2 MiB `max-page-size`). At the start of a proxy role
//! those 2 MiB are copied into an anonymous mapping advised for huge pages and moved over the
//! original (`mremap`), so the request path is one TLB entry instead of ~80: a request that
//! finds the caches cold, as one between other processes' work does, walks no page tables for
//! it (docs/benchmarks.md, "Hot code on few pages"). Node.js does the same
//! (`--use-largepages`).
//!
//! The copy is byte for byte and read-only-executable again before it replaces the original;
//! any step that fails leaves the original mapping in place. It costs 2 MiB of memory that is
//! no longer shared with other processes running the binary, and profilers that read symbols
//! through `/proc/<pid>/maps` see that range as anonymous: `TOKENWAY_HUGE_TEXT=off` skips it
//! (the profiling scripts set it).

/// The size of a transparent huge page on x86-64.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
const HUGE: usize = 2 << 20;

/// What [`remap`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The first 2 MiB of code are on one huge page.
    Huge,
    /// The code was moved, but the kernel backed it with small pages (no huge page free).
    Small,
    /// Left as it was, and why.
    Skipped(String),
}

/// Moves the first 2 MiB of the code segment onto a huge page, unless `TOKENWAY_HUGE_TEXT` is
/// `off`, transparent huge pages are disabled, or the binary was not linked for it. Call it
/// before other threads start: a thread running code in that range while it moves would be
/// fine (the bytes are the same), one that maps memory there would not.
pub fn remap() -> Outcome {
    if std::env::var("TOKENWAY_HUGE_TEXT").as_deref() == Ok("off") {
        return Outcome::Skipped("TOKENWAY_HUGE_TEXT=off".to_owned());
    }
    imp::remap()
}

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod imp {
    use super::{Outcome, HUGE};

    /// The start and length of the executable's code segment (its `PT_LOAD` with `PF_X`).
    fn code_segment() -> Option<(usize, usize)> {
        unsafe extern "C" fn first_object(
            info: *mut libc::dl_phdr_info,
            _size: libc::size_t,
            data: *mut libc::c_void,
        ) -> libc::c_int {
            // SAFETY: the loader passes a valid `info` for the duration of the call, and
            // `data` is the `Option` below, borrowed mutably for the whole iteration.
            let (info, found) = unsafe { (&*info, &mut *data.cast::<Option<(usize, usize)>>()) };
            // SAFETY: `dlpi_phdr` points to `dlpi_phnum` program headers.
            let headers =
                unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
            *found = headers
                .iter()
                .find(|h| h.p_type == libc::PT_LOAD && h.p_flags & libc::PF_X != 0)
                .map(|h| {
                    let start = info.dlpi_addr as usize + h.p_vaddr as usize;
                    (start, h.p_memsz as usize)
                });
            1 // the first object is the executable itself; stop there
        }
        let mut found: Option<(usize, usize)> = None;
        // SAFETY: the callback only reads what the loader hands it and writes `found`.
        unsafe {
            libc::dl_iterate_phdr(Some(first_object), (&raw mut found).cast());
        }
        found
    }

    fn thp_enabled() -> bool {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| s.contains("[always]") || s.contains("[madvise]"))
    }

    pub fn remap() -> Outcome {
        let skip = |why: &str| Outcome::Skipped(why.to_owned());
        if !thp_enabled() {
            return skip("transparent huge pages are disabled");
        }
        let Some((start, len)) = code_segment() else {
            return skip("no code segment found");
        };
        if start % HUGE != 0 {
            return skip("the code segment does not start on a 2 MiB boundary");
        }
        if len < HUGE {
            return skip("the code segment is smaller than 2 MiB");
        }
        // SAFETY: every call below checks its result; `start..start + HUGE` is mapped readable
        // code (inside the segment found above), the copy goes to memory this function mapped,
        // and `mremap` replaces the original only with an identical copy, atomically.
        unsafe {
            // Twice the size, to find a 2 MiB-aligned window in it; the rest is unmapped.
            let area = libc::mmap(
                std::ptr::null_mut(),
                2 * HUGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if area == libc::MAP_FAILED {
                return skip("cannot map memory for the copy");
            }
            let area = area as usize;
            let copy = area.next_multiple_of(HUGE);
            if copy > area {
                libc::munmap(area as *mut libc::c_void, copy - area);
            }
            libc::munmap((copy + HUGE) as *mut libc::c_void, area + HUGE - copy);
            let copy_ptr = copy as *mut libc::c_void;
            let fail = |why: &str| {
                libc::munmap(copy_ptr, HUGE);
                Outcome::Skipped(why.to_owned())
            };
            if libc::madvise(copy_ptr, HUGE, libc::MADV_HUGEPAGE) != 0 {
                return fail("madvise(MADV_HUGEPAGE) failed");
            }
            std::ptr::copy_nonoverlapping(start as *const u8, copy as *mut u8, HUGE);
            if libc::mprotect(copy_ptr, HUGE, libc::PROT_READ | libc::PROT_EXEC) != 0 {
                return fail("mprotect of the copy failed");
            }
            let moved = libc::mremap(
                copy_ptr,
                HUGE,
                HUGE,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                start as *mut libc::c_void,
            );
            if moved == libc::MAP_FAILED {
                return fail("mremap over the code failed");
            }
        }
        if huge_at(start) {
            Outcome::Huge
        } else {
            Outcome::Small
        }
    }

    /// Whether the mapping at `start` is backed by anonymous huge pages (`/proc/self/smaps`).
    fn huge_at(start: usize) -> bool {
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            return false;
        };
        let head = format!("{start:x}-");
        smaps
            .lines()
            .skip_while(|l| !l.starts_with(&head))
            .skip(1)
            .take_while(|l| l.starts_with(|c: char| c.is_ascii_uppercase()))
            .any(|l| l.starts_with("AnonHugePages:") && !l.ends_with(" 0 kB"))
    }
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
mod imp {
    use super::Outcome;

    pub fn remap() -> Outcome {
        Outcome::Skipped("only on x86-64 Linux".to_owned())
    }
}
