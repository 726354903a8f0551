//! KTAP v1 output (Documentation/dev-tools/ktap.rst): one top-level test per suite, one
//! subtest per check.

use std::fmt::Write as _;

/// The result of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The check held.
    Pass,
    /// The check failed, with the reason.
    Fail(String),
    /// The check could not run here, with the reason.
    Skip(String),
}

/// One check: its name, diagnostic lines and verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Name (no spaces or `#`).
    pub name: String,
    /// Lines printed as `# ...` before the result.
    pub diagnostics: Vec<String>,
    /// The outcome.
    pub verdict: Verdict,
}

impl Check {
    /// A check with no diagnostics.
    pub fn new(name: &str, verdict: Verdict) -> Self {
        Check { name: sanitize(name), diagnostics: Vec::new(), verdict }
    }

    /// Adds a diagnostic line.
    pub fn note(mut self, line: impl Into<String>) -> Self {
        self.diagnostics.push(line.into());
        self
    }
}

/// A suite's checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuiteReport {
    /// Suite name.
    pub name: String,
    /// Its checks, in order.
    pub checks: Vec<Check>,
}

impl SuiteReport {
    /// True when no check failed (skips do not fail a suite).
    pub fn passed(&self) -> bool {
        !self.checks.iter().any(|c| matches!(c.verdict, Verdict::Fail(_)))
    }
}

fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_whitespace() || c == '#' { '_' } else { c }).collect()
}

fn result_line(out: &mut String, indent: &str, n: usize, name: &str, verdict: &Verdict) {
    let _ = match verdict {
        Verdict::Pass => writeln!(out, "{indent}ok {n} {name}"),
        Verdict::Fail(reason) => {
            let _ = writeln!(out, "{indent}# {name}: {reason}");
            writeln!(out, "{indent}not ok {n} {name}")
        }
        Verdict::Skip(reason) => writeln!(out, "{indent}ok {n} {name} # SKIP {reason}"),
    };
}

/// Renders a whole KTAP document for `suites`.
pub fn render(suites: &[SuiteReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "KTAP version 1");
    let _ = writeln!(out, "1..{}", suites.len());
    for (i, suite) in suites.iter().enumerate() {
        let _ = writeln!(out, "    KTAP version 1");
        let _ = writeln!(out, "    # Subtest: {}", suite.name);
        let _ = writeln!(out, "    1..{}", suite.checks.len());
        for (j, check) in suite.checks.iter().enumerate() {
            for d in &check.diagnostics {
                let _ = writeln!(out, "    # {d}");
            }
            result_line(&mut out, "    ", j + 1, &check.name, &check.verdict);
        }
        let verdict = if suite.passed() { Verdict::Pass } else { Verdict::Fail("a check failed".into()) };
        result_line(&mut out, "", i + 1, &suite.name, &verdict);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_render_nested_ktap() {
        let suites = vec![SuiteReport {
            name: "smoke".into(),
            checks: vec![
                Check::new("kernel release", Verdict::Pass).note("release 6.1.0-57-amd64"),
                Check::new("online_cpus", Verdict::Fail("2 online, 4 configured".into())),
                Check::new("memory", Verdict::Skip("no expectations".into())),
            ],
        }];
        assert_eq!(
            render(&suites),
            "KTAP version 1\n1..1\n    KTAP version 1\n    # Subtest: smoke\n    1..3\n    # release 6.1.0-57-amd64\n    ok 1 kernel_release\n    # online_cpus: 2 online, 4 configured\n    not ok 2 online_cpus\n    ok 3 memory # SKIP no expectations\n# smoke: a check failed\nnot ok 1 smoke\n"
        );
        assert!(!suites[0].passed());
    }
}
