//! The one output format of every command: a JSON object per result line on stdout.

use std::io::Write;

use serde::{Deserialize, Serialize};

/// One result: `{"test": NAME, "ok": bool, "diag": [..], "skip": reason?, "data": {..}?}`.
/// A failed result's reason is its last `diag` line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestResult {
    /// Test name (no spaces).
    pub test: String,
    /// Whether it held (true for skips).
    pub ok: bool,
    /// Diagnostic lines, the reason of a failure last.
    pub diag: Vec<String>,
    /// Why the test could not run, when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip: Option<String>,
    /// Structured detail for programs (the `query` command's device description).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
}

impl TestResult {
    /// A passed test with its diagnostics.
    pub fn pass(test: &str, diag: Vec<String>) -> Self {
        TestResult { test: test.to_owned(), ok: true, diag, skip: None, data: None }
    }

    /// A failed test: its diagnostics, then the reason as the last line.
    pub fn fail(test: &str, mut diag: Vec<String>, reason: impl Into<String>) -> Self {
        diag.push(reason.into());
        TestResult { test: test.to_owned(), ok: false, diag, skip: None, data: None }
    }

    /// Passed when `problem` is `None`, failed with it otherwise.
    pub fn from_outcome(test: &str, diag: Vec<String>, problem: Option<String>) -> Self {
        match problem {
            None => Self::pass(test, diag),
            Some(p) => Self::fail(test, diag, p),
        }
    }
}

/// Where results go: printed at once (so a killed run keeps what it had) and kept.
#[derive(Default)]
pub struct Emitter {
    /// Everything emitted so far.
    pub results: Vec<TestResult>,
    /// Print to stdout (off in unit tests).
    pub print: bool,
}

impl Emitter {
    /// An emitter that prints.
    pub fn stdout() -> Self {
        Emitter { results: Vec::new(), print: true }
    }

    /// Records `r` and prints it as one JSON line.
    pub fn emit(&mut self, r: TestResult) {
        if self.print {
            let line = serde_json::to_string(&r).unwrap_or_else(|e| {
                format!("{{\"test\":\"{}\",\"ok\":false,\"diag\":[\"unserializable result: {e}\"]}}", r.test)
            });
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }
        self.results.push(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_json_shape() {
        let r = TestResult::fail("rdma_write_4096", vec!["posted".into()], "no completion within 10 s");
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(json, r#"{"test":"rdma_write_4096","ok":false,"diag":["posted","no completion within 10 s"]}"#);
        let s = TestResult { skip: Some("no peer".into()), ..TestResult::pass("pair", vec![]) };
        assert_eq!(serde_json::to_string(&s).unwrap(), r#"{"test":"pair","ok":true,"diag":[],"skip":"no peer"}"#);
        let back: TestResult = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
    }
}
