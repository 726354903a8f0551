//! Reading KTAP v1 from a console stream that also carries kernel messages.

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaseOutcome {
    /// `ok`.
    Pass,
    /// `not ok`.
    Fail,
    /// `ok ... # SKIP reason`.
    Skip(String),
}

/// One check of a suite.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaseResult {
    /// Check name.
    pub name: String,
    /// Outcome.
    pub outcome: CaseOutcome,
    /// `# ...` lines printed before the result.
    pub diagnostics: Vec<String>,
}

/// One suite (a top-level KTAP test with subtests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuiteResult {
    /// Suite name.
    pub name: String,
    /// True when the top-level line said `ok`.
    pub ok: bool,
    /// Its checks.
    pub cases: Vec<CaseResult>,
}

impl SuiteResult {
    /// Counts of (passed, failed, skipped) checks.
    pub fn counts(&self) -> (usize, usize, usize) {
        self.cases.iter().fold((0, 0, 0), |(p, f, s), c| match c.outcome {
            CaseOutcome::Pass => (p + 1, f, s),
            CaseOutcome::Fail => (p, f + 1, s),
            CaseOutcome::Skip(_) => (p, f, s + 1),
        })
    }
}

/// Everything a console carried.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KtapReport {
    /// Suites in order.
    pub suites: Vec<SuiteResult>,
    /// The top-level plan (`1..N`), if seen.
    pub planned: Option<usize>,
}

impl KtapReport {
    /// True when a plan was seen and every planned suite reported.
    pub fn complete(&self) -> bool {
        self.planned == Some(self.suites.len())
    }

    /// True when complete and every suite passed.
    pub fn all_ok(&self) -> bool {
        self.complete() && self.suites.iter().all(|s| s.ok)
    }

    /// Counts of (passed, failed, skipped) checks.
    pub fn counts(&self) -> (usize, usize, usize) {
        self.suites.iter().map(SuiteResult::counts).fold((0, 0, 0), |(p, f, s), (sp, sf, ss)| (p + sp, f + sf, s + ss))
    }
}

/// A result line: `ok 3 name # SKIP why` → (ok, name, directive).
fn result_line(line: &str) -> Option<(bool, String, Option<String>)> {
    let (ok, rest) =
        if let Some(r) = line.strip_prefix("not ok ") { (false, r) } else { (true, line.strip_prefix("ok ")?) };
    let (_, rest) = rest.split_once(' ').unwrap_or((rest, ""));
    let (name, directive) = match rest.split_once(" # ") {
        Some((n, d)) => (n, Some(d.trim().to_owned())),
        None => (rest, None),
    };
    Some((ok, name.trim().to_owned(), directive))
}

/// Parses the KTAP document in `console`, ignoring lines that are not KTAP.
pub fn parse(console: &str) -> KtapReport {
    let mut report = KtapReport::default();
    let mut started = false;
    let mut cases = Vec::new();
    let mut diagnostics = Vec::new();
    for raw in console.lines() {
        let line = raw.trim_end_matches('\r');
        if line == "KTAP version 1" {
            // A new document starts over (a guest that rebooted prints a second one).
            report = KtapReport::default();
            cases.clear();
            diagnostics.clear();
            started = true;
            continue;
        }
        if !started {
            continue;
        }
        if let Some(sub) = line.strip_prefix("    ") {
            if let Some(d) = sub.strip_prefix("# ").filter(|d| !d.starts_with("Subtest:")) {
                diagnostics.push(d.to_owned());
            } else if let Some((ok, name, directive)) = result_line(sub) {
                let outcome = match directive {
                    Some(d) if d.to_ascii_uppercase().starts_with("SKIP") => {
                        CaseOutcome::Skip(d[4..].trim().to_owned())
                    }
                    _ if ok => CaseOutcome::Pass,
                    _ => CaseOutcome::Fail,
                };
                cases.push(CaseResult { name, outcome, diagnostics: std::mem::take(&mut diagnostics) });
            }
        } else if let Some(plan) = line.strip_prefix("1..") {
            report.planned = plan.split_whitespace().next().and_then(|n| n.parse().ok());
        } else if let Some((ok, name, _)) = result_line(line) {
            report.suites.push(SuiteResult { name, ok, cases: std::mem::take(&mut cases) });
            diagnostics.clear();
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONSOLE: &str = "[    5.66] PCI: Fatal: No config space access function found\r
KTAP version 1
1..1
    KTAP version 1
    # Subtest: smoke
    1..3
    # release 6.1.0-57-amd64
    ok 1 kernel_release
[   11.2] random: crng init done
    # online_cpus: 1 online, 2 configured
    not ok 2 online_cpus
    ok 3 memory # SKIP no VMM expectations
# smoke: a check failed
not ok 1 smoke
[   12.26] reboot: Power down
";

    #[test]
    fn test_parse_interleaved_console() {
        let r = parse(CONSOLE);
        assert!(r.complete());
        assert!(!r.all_ok());
        assert_eq!(r.counts(), (1, 1, 1));
        let s = &r.suites[0];
        assert_eq!(s.name, "smoke");
        assert_eq!(s.cases[0].diagnostics, vec!["release 6.1.0-57-amd64"]);
        assert_eq!(s.cases[1].diagnostics, vec!["online_cpus: 1 online, 2 configured"]);
        assert_eq!(s.cases[2].outcome, CaseOutcome::Skip("no VMM expectations".into()));
    }

    #[test]
    fn test_truncated_output_is_incomplete() {
        let cut = &CONSOLE[..CONSOLE.find("not ok 1 smoke").unwrap()];
        let r = parse(cut);
        assert_eq!(r.planned, Some(1));
        assert!(!r.complete());
        assert!(parse("no ktap at all\n").suites.is_empty());
    }

    #[test]
    fn test_snapshot_of_parsed_report() {
        insta::assert_debug_snapshot!(parse(CONSOLE));
    }
}
