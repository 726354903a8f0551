//! The host's side of nested runs: reading the L1 console (see `gdrvm_model::l1`).

use gdrvm_model::l1::MARKER;

/// A line from the L1 console, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum L1Line<'a> {
    /// L1 loaded KVM and is about to run jobs.
    Ready,
    /// L1 cannot run jobs.
    Error(&'a str),
    /// Job `n` started.
    JobStart(usize),
    /// A console or log line of job `n`.
    JobOutput(usize, &'a str),
    /// Job `n` printed its first KTAP line `millis` after it started.
    JobKtap { job: usize, millis: u64 },
    /// The exits KVM counted for job `n`'s VM until its first KTAP line (JSON of
    /// [`gdrvm_model::kvm_exits::KvmExits`]).
    JobExits { job: usize, json: &'a str },
    /// Job `n`'s exits by reason and MSR accesses until its first KTAP line (JSON of
    /// [`gdrvm_model::kvm_exits::ExitReasons`]).
    JobReasons { job: usize, json: &'a str },
    /// Job `n` exited with `code` after `millis`.
    JobExit { job: usize, code: i32, millis: u64 },
    /// Job `n` ran past its timeout and was killed.
    JobTimeout(usize),
    /// Where a job that ran past its timeout is stuck (one line of the report).
    Stuck(&'a str),
    /// All jobs done; L1 powers off.
    Done,
    /// Anything else (L1's kernel messages).
    Other(&'a str),
}

/// Classifies one L1 console line.
pub fn classify(line: &str) -> L1Line<'_> {
    let line = line.trim_end_matches('\r');
    if let Some(rest) = line.strip_prefix(MARKER) {
        let words: Vec<&str> = rest.split_whitespace().collect();
        return match words.as_slice() {
            ["ready"] => L1Line::Ready,
            ["done"] => L1Line::Done,
            ["error", ..] => L1Line::Error(rest["error".len()..].trim()),
            ["stuck", ..] => L1Line::Stuck(rest),
            ["job", n, "start"] => n.parse().map_or(L1Line::Other(line), L1Line::JobStart),
            ["job", n, "timeout"] => n.parse().map_or(L1Line::Other(line), L1Line::JobTimeout),
            ["job", n, "ktap", ms] => match (n.parse(), ms.parse()) {
                (Ok(job), Ok(millis)) => L1Line::JobKtap { job, millis },
                _ => L1Line::Other(line),
            },
            ["job", n, "exits", json] => n.parse().map_or(L1Line::Other(line), |job| L1Line::JobExits { job, json }),
            // The JSON's keys have spaces: it is the rest of the line.
            ["job", n, "reasons", ..] => match (n.parse(), rest.split_once(" reasons ")) {
                (Ok(job), Some((_, json))) => L1Line::JobReasons { job, json: json.trim() },
                _ => L1Line::Other(line),
            },
            ["job", n, "exit", code, ms] => match (n.parse(), code.parse(), ms.parse()) {
                (Ok(job), Ok(code), Ok(millis)) => L1Line::JobExit { job, code, millis },
                _ => L1Line::Other(line),
            },
            _ => L1Line::Other(line),
        };
    }
    if let Some(rest) = line.strip_prefix("@@") {
        if let Some((n, text)) = rest.split_once('|') {
            if let Ok(job) = n.parse() {
                return L1Line::JobOutput(job, text);
            }
        }
    }
    L1Line::Other(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_classify_markers() {
        assert_eq!(classify("@@gdrvm-l1 ready\r"), L1Line::Ready);
        assert_eq!(classify("@@gdrvm-l1 job 2 start"), L1Line::JobStart(2));
        assert_eq!(classify("@@1|    ok 1 kernel_release"), L1Line::JobOutput(1, "    ok 1 kernel_release"));
        assert_eq!(classify("@@gdrvm-l1 job 0 exit 1 15234"), L1Line::JobExit { job: 0, code: 1, millis: 15234 });
        assert_eq!(classify("@@gdrvm-l1 job 0 timeout"), L1Line::JobTimeout(0));
        assert_eq!(
            classify("@@gdrvm-l1 stuck task 91 (vcpu0) state R wchan 0"),
            L1Line::Stuck("stuck task 91 (vcpu0) state R wchan 0")
        );
        assert_eq!(classify("@@gdrvm-l1 job 3 ktap 9120"), L1Line::JobKtap { job: 3, millis: 9120 });
        assert_eq!(
            classify(r#"@@gdrvm-l1 job 3 exits {"exits":812,"io_exits":90}"#),
            L1Line::JobExits { job: 3, json: r#"{"exits":812,"io_exits":90}"# }
        );
        assert_eq!(
            classify(r#"@@gdrvm-l1 job 2 reasons {"msr write 0x6e0 TSC deadline":9,"reason hlt":4}"#),
            L1Line::JobReasons { job: 2, json: r#"{"msr write 0x6e0 TSC deadline":9,"reason hlt":4}"# }
        );
        assert_eq!(
            classify("@@gdrvm-l1 error no /dev/kvm: kvm_amd: ENODEV"),
            L1Line::Error("no /dev/kvm: kvm_amd: ENODEV")
        );
        assert_eq!(classify("[ 14.5] kvm: Unhandled WRMSR"), L1Line::Other("[ 14.5] kvm: Unhandled WRMSR"));
        assert_eq!(classify("@@x|y"), L1Line::Other("@@x|y"));
    }
}
