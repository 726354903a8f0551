//! JUnit XML for CI systems, from parsed KTAP.

use std::fmt::Write as _;

use crate::ktap::{CaseOutcome, KtapReport};

fn escape(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_control() || *c == '\n' || *c == '\t')
        .map(|c| match c {
            '&' => "&amp;".to_owned(),
            '<' => "&lt;".to_owned(),
            '>' => "&gt;".to_owned(),
            '"' => "&quot;".to_owned(),
            '\'' => "&apos;".to_owned(),
            c => c.to_string(),
        })
        .collect()
}

/// Renders `report` (from the run called `run_name`) as a JUnit `<testsuites>` document.
/// `problem`, when given, is a run-level failure (timeout, panic) recorded as an error.
pub fn render(run_name: &str, report: &KtapReport, problem: Option<&str>) -> String {
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let (pass, fail, skip) = report.counts();
    let errors = usize::from(problem.is_some());
    let _ = writeln!(
        out,
        "<testsuites name=\"{}\" tests=\"{}\" failures=\"{fail}\" errors=\"{errors}\" skipped=\"{skip}\">",
        escape(run_name),
        pass + fail + skip + errors
    );
    for suite in &report.suites {
        let (_, f, s) = suite.counts();
        let _ = writeln!(
            out,
            "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{f}\" skipped=\"{s}\">",
            escape(&suite.name),
            suite.cases.len()
        );
        for case in &suite.cases {
            let _ = write!(out, "    <testcase classname=\"{}\" name=\"{}\"", escape(&suite.name), escape(&case.name));
            let text = escape(&case.diagnostics.join("\n"));
            let _ = match &case.outcome {
                CaseOutcome::Pass if text.is_empty() => writeln!(out, "/>"),
                CaseOutcome::Pass => writeln!(out, "><system-out>{text}</system-out></testcase>"),
                CaseOutcome::Fail => writeln!(
                    out,
                    "><failure message=\"{}\">{text}</failure></testcase>",
                    escape(case.diagnostics.last().map_or("failed", |d| d))
                ),
                CaseOutcome::Skip(why) => writeln!(out, "><skipped message=\"{}\"/></testcase>", escape(why)),
            };
        }
        let _ = writeln!(out, "  </testsuite>");
    }
    if let Some(problem) = problem {
        let _ = writeln!(out, "  <testsuite name=\"{}\" tests=\"1\" errors=\"1\">", escape(run_name));
        let _ = writeln!(
            out,
            "    <testcase classname=\"{0}\" name=\"run\"><error message=\"{1}\">{1}</error></testcase>",
            escape(run_name),
            escape(problem)
        );
        let _ = writeln!(out, "  </testsuite>");
    }
    out.push_str("</testsuites>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ktap;

    #[test]
    fn test_junit_snapshot() {
        let report = ktap::parse(
            "KTAP version 1\n1..1\n    KTAP version 1\n    # Subtest: smoke\n    1..3\n    ok 1 a\n    # a <b> & \"c\"\n    not ok 2 b\n    ok 3 c # SKIP why\nnot ok 1 smoke\n",
        );
        insta::assert_snapshot!(render("boot", &report, Some("guest panicked")));
    }
}
