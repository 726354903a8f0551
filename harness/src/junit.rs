//! JUnit XML for CI systems, from parsed KTAP.

use std::fmt::Write as _;

use crate::ktap::{CaseOutcome, CaseResult, KtapReport};

/// Escapes `s` for XML text and attribute values, dropping the control characters XML 1.0
/// forbids (all but newline and tab). Also used by `cargo xtask`'s matrix JUnit.
pub fn escape(s: &str) -> String {
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

/// Writes one `<testcase>` line for KTAP case `case` of class `classname` (both escaped
/// here): a failure with its diagnostics, a skip with its reason, diagnostics as
/// `<system-out>`, in the order the schema wants (skipped, failure, system-out).
pub fn write_testcase(out: &mut String, classname: &str, case: &CaseResult) {
    let _ = write!(out, "    <testcase classname=\"{}\" name=\"{}\"", escape(classname), escape(&case.name));
    let text = escape(&case.diagnostics.join("\n"));
    let output = if text.is_empty() { String::new() } else { format!("<system-out>{text}</system-out>") };
    let _ = match &case.outcome {
        CaseOutcome::Pass if text.is_empty() => writeln!(out, "/>"),
        CaseOutcome::Pass => writeln!(out, ">{output}</testcase>"),
        CaseOutcome::Fail => writeln!(
            out,
            "><failure message=\"{}\">{text}</failure></testcase>",
            escape(case.diagnostics.last().map_or("failed", |d| d))
        ),
        CaseOutcome::Skip(why) => writeln!(out, "><skipped>{}</skipped>{output}</testcase>", escape(why)),
    };
}

/// Renders `report` (from the run called `run_name`) as a JUnit `<testsuites>` document
/// that the common JUnit schema (Jenkins' `junit.xsd`) accepts: no `skipped` count on the
/// root, a skip's reason as the `<skipped>` element's text. `problem`, when given, is a
/// run-level failure (timeout, panic) recorded as an error.
pub fn render(run_name: &str, report: &KtapReport, problem: Option<&str>) -> String {
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let (pass, fail, skip) = report.counts();
    let errors = usize::from(problem.is_some());
    let _ = writeln!(
        out,
        "<testsuites name=\"{}\" tests=\"{}\" failures=\"{fail}\" errors=\"{errors}\">",
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
            write_testcase(&mut out, &suite.name, case);
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
