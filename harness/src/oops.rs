//! Kernel oopses in a console (the guest's or L1's): where one starts, and the signature
//! that tells one from another in a soak's table (the first line, RIP, the task and CPU).

/// Lines that open a kernel oops or panic report, in the kernel's words.
const HEADLINES: &[&str] = &[
    "BUG: ",
    "Oops: ",
    "general protection fault",
    "Bad pagetable: ",
    "kernel BUG at",
    "stack guard page was hit",
    "double fault",
    "Kernel panic - not syncing",
    "WARNING: CPU: ",
];

/// Lines kept from an oops on: enough for the registers, the trace and the panic line.
pub const OOPS_LINES: usize = 120;

/// One oops found in a console.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Oops {
    /// Index of its first line in the console.
    pub at: usize,
    /// The first line (timestamp removed).
    pub headline: String,
    /// Where the CPU was (`RIP: 0010:error_entry+0x1a/0xd0`), when reported.
    pub rip: Option<String>,
    /// Which task and CPU (`CPU: 1 PID: 311 Comm: gdrvm`), when reported.
    pub task: Option<String>,
}

impl Oops {
    /// A kernel stack overflow hit inside the exception entry code (`error_entry` page
    /// faulting on its own pushes until the guard page) or at the page-fault handler's
    /// first steps (`exc_page_fault` reading CR2 and the per-CPU current task, on an entry
    /// stack): page faults on memory that is mapped, over and over. Nested under QEMU TCG
    /// this is how its nested paging loses a kernel now and then (L1's and a guest's alike,
    /// measured 2026-12-01/02, and in `exc_page_fault` on 2026-12-03); a real kernel bug
    /// overflows its task stack elsewhere, and the double fault names that place.
    pub fn is_entry_fault_recursion(&self) -> bool {
        let overflow =
            ["stack guard page was hit", "double fault", "stack overflow"].iter().any(|h| self.headline.contains(h));
        let entry = [":error_entry+", ":exc_page_fault+"];
        overflow && self.rip.as_deref().is_some_and(|r| entry.iter().any(|e| r.contains(e)))
    }

    /// The exception frame the oops prints cannot have been pushed by a CPU: its code
    /// segment is the null selector (`RIP: 0000:...`), which no x86-64 context can run
    /// with. Nested under QEMU TCG an interrupt is now and then delivered so: on
    /// 2026-12-04 CI's flat guest died of `Bad pagetable: fcc8` (no page-fault error code
    /// has those bits) with `RIP: 0000:` pointing into kernel data and RSP, SS and EFLAGS
    /// holding kernel addresses, one slot off; the stop before saw `RIP: 0:0` with a NULL
    /// dereference on an idle CPU. A kernel's own bug faults with its real selector
    /// (`0010`, `0033`), whatever it corrupted.
    pub fn has_impossible_frame(&self) -> bool {
        self.rip.as_deref().is_some_and(|r| r.starts_with("RIP: 0000:"))
    }

    /// One line for tables: headline, task, RIP.
    pub fn signature(&self) -> String {
        let mut s = self.headline.clone();
        for part in [&self.task, &self.rip].into_iter().flatten() {
            s.push_str(" | ");
            s.push_str(part);
        }
        s
    }
}

/// Whether `line` reports a kernel-mode fault inside the exception entry code (`RIP:
/// 0010:error_entry+...`), anywhere in it: an oops's lines on a guest's console can be cut
/// into the agent's output. `error_entry` touches only its own stack and per-CPU data, both
/// always mapped, so a CPU that faults there was lost by the emulator, not by the kernel:
/// on 2026-12-03 a nested guest oopsed so on an idle CPU, went on, and exited 0 with the
/// oops spliced into a suite's output.
pub fn faulted_in_entry_code(line: &str) -> bool {
    line.contains("RIP: 0010:error_entry+")
}

/// A console line without the kernel's `[    1.234567] ` timestamp.
fn text(line: &str) -> &str {
    let t = line.trim_start();
    match t.strip_prefix('[').and_then(|r| r.split_once("] ")) {
        Some((stamp, rest)) if stamp.trim().chars().all(|c| c.is_ascii_digit() || c == '.') => rest,
        _ => t,
    }
}

/// The first oops in `lines`, if any.
pub fn find(lines: &[String]) -> Option<Oops> {
    let at = lines.iter().position(|l| HEADLINES.iter().any(|h| text(l).starts_with(h)))?;
    let after = &lines[at..lines.len().min(at + OOPS_LINES)];
    let field =
        |prefix: &str| after.iter().map(|l| text(l)).find_map(|t| t.find(prefix).map(|i| t[i..].trim_end().to_owned()));
    let task = field("CPU: ").map(|t| {
        // "CPU: 1 PID: 311 Comm: gdrvm Not tainted 6.1.0-57-amd64 #1 Debian ..."
        let end = [" Not tainted", " Tainted:"].iter().filter_map(|m| t.find(m)).min().unwrap_or(t.len());
        t[..end].to_owned()
    });
    Some(Oops { at, headline: text(&lines[at]).trim_end().to_owned(), rip: field("RIP: "), task })
}

/// The lines of `lines` worth keeping for a report about `oops`: a few before it, up to
/// [`OOPS_LINES`] from it, and the last lines of the console.
pub fn excerpt(lines: &[String], oops: Option<&Oops>, tail: usize) -> Vec<String> {
    let tail_from = lines.len().saturating_sub(tail);
    let Some(oops) = oops else { return lines[tail_from..].to_vec() };
    let from = oops.at.saturating_sub(5);
    let to = lines.len().min(oops.at + OOPS_LINES);
    let mut out = lines[from..to].to_vec();
    if tail_from > to {
        out.push(format!("[... {} lines ...]", tail_from - to));
    }
    out.extend_from_slice(&lines[tail_from.max(to)..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(s: &str) -> Vec<String> {
        s.lines().map(str::to_owned).collect()
    }

    #[test]
    fn test_finds_the_signature_of_a_stack_overflow_oops() {
        let console = lines(
            "[   90.1] kvm: Unhandled WRMSR\n\
             [   91.2] BUG: stack guard page was hit at 00000000a1b2c3d4 (stack is 0000000011111111..0000000022222222)\n\
             [   91.2] kernel stack overflow (double-fault): 0000 [#1] PREEMPT SMP NOPTI\n\
             [   91.2] CPU: 1 PID: 311 Comm: qemu-system-x86 Not tainted 6.1.0-57-amd64 #1  Debian 6.1.192-3\n\
             [   91.2] RIP: 0010:error_entry+0x1a/0xd0\n\
             [   91.2] RBP: 00000000000008e0\n\
             [   91.3] Kernel panic - not syncing: Fatal exception in interrupt",
        );
        let oops = find(&console).unwrap();
        assert_eq!(oops.at, 1);
        assert!(oops.headline.starts_with("BUG: stack guard page was hit"));
        assert_eq!(oops.task.as_deref(), Some("CPU: 1 PID: 311 Comm: qemu-system-x86"));
        assert_eq!(oops.rip.as_deref(), Some("RIP: 0010:error_entry+0x1a/0xd0"));
        assert!(oops.signature().contains("Comm: qemu-system-x86 | RIP: 0010:error_entry"));
        assert!(oops.is_entry_fault_recursion());
        assert_eq!(excerpt(&console, Some(&oops), 40), console);
        // The same overflow elsewhere, or another oops in error_entry, is the kernel's own.
        let in_handler = lines(&console.join("\n").replace("error_entry+0x1a/0xd0", "exc_page_fault+0x15/0x170"));
        assert!(find(&in_handler).unwrap().is_entry_fault_recursion());
        let elsewhere = lines(&console.join("\n").replace("error_entry+0x1a", "ext4_readdir+0x1a"));
        assert!(!find(&elsewhere).unwrap().is_entry_fault_recursion());
        let null = lines(&console.join("\n").replace("stack guard page was hit", "kernel NULL pointer dereference"));
        assert!(!find(&null).unwrap().is_entry_fault_recursion());
    }

    /// The flat guest's death in CI on 2026-12-04, as its console showed it.
    const NULL_CS: &str = "[    9.380342] init: Corrupted page table at address 38\n\
        [    9.382521] PGD 0 P4D 0 \n\
        [    9.382521] Bad pagetable: fcc8 [#1] PREEMPT SMP NOPTI\n\
        [    9.382521] CPU: 0 PID: 1 Comm: init Not tainted 6.1.0-57-amd64 #1  Debian 6.1.192-3\n\
        [    9.382521] RIP: 0000:0xffff88800517ca00\n\
        [    9.382521] RSP: 20312a80:0000001881e01785 EFLAGS: ffffffff816a8ab2\n\
        [    9.382521] Kernel panic - not syncing: Fatal exception in interrupt";

    #[test]
    fn test_a_frame_with_the_null_code_segment_is_impossible() {
        let oops = find(&lines(NULL_CS)).unwrap();
        assert_eq!(oops.at, 2);
        assert!(oops.headline.starts_with("Bad pagetable: fcc8"));
        assert_eq!(oops.rip.as_deref(), Some("RIP: 0000:0xffff88800517ca00"));
        assert!(oops.has_impossible_frame());
        assert!(!oops.is_entry_fault_recursion());
        // The kernel's own faults carry its selectors.
        for cs in ["0010", "0033"] {
            let own = lines(&NULL_CS.replace("RIP: 0000:", &format!("RIP: {cs}:")));
            assert!(!find(&own).unwrap().has_impossible_frame(), "{cs}");
        }
    }

    #[test]
    fn test_a_fault_in_entry_code_is_found_inside_other_output() {
        assert!(faulted_in_entry_code("subsystem = [0x1[   13.931881] RIP: 0010:error_entry+0xd/0x130"));
        assert!(faulted_in_entry_code("[   13.9] RIP: 0010:error_entry+0x1a/0xd0"));
        // User mode, or another function of the entry code, is not it.
        assert!(!faulted_in_entry_code("[   13.9] RIP: 0033:error_entry+0x1a/0xd0"));
        assert!(!faulted_in_entry_code("[   13.9] RIP: 0010:asm_exc_page_fault+0x22/0x30"));
    }

    #[test]
    fn test_no_oops_in_a_clean_console_and_excerpt_is_the_tail() {
        let console: Vec<String> = (0..300).map(|i| format!("[ {i}.0] line {i}")).collect();
        assert_eq!(find(&console), None);
        assert_eq!(excerpt(&console, None, 40).len(), 40);
        let mut long = console.clone();
        long.insert(10, "[ 9.9] general protection fault, probably for non-canonical address".into());
        // A line that only quotes an oops (a harness note) is not one.
        assert_eq!(find(&["L1: L1 Stall: watchdog: BUG: soft lockup".to_owned()]), None);
        let oops = find(&long).unwrap();
        let ex = excerpt(&long, Some(&oops), 40);
        assert_eq!(ex[5], long[10]);
        assert!(ex.iter().any(|l| l.starts_with("[... ")), "{ex:?}");
        assert_eq!(ex.last(), long.last());
    }
}
