//! Running a helper program (gdrvm-verbs, perftest, rdma) with a deadline: its output is
//! collected, and a program that outlives its time is killed and reported as such.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// `120 s`, or `0.3 s` below a second.
pub fn secs(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// How a program ended.
#[derive(Debug)]
pub struct Outcome {
    /// The command line, for messages.
    pub command: String,
    /// Its exit status; `None` when it was killed for running too long.
    pub status: Option<ExitStatus>,
    /// Everything it printed on stdout.
    pub stdout: String,
    /// Everything it printed on stderr.
    pub stderr: String,
    /// How long it ran.
    pub elapsed: Duration,
    /// The limit it ran under.
    pub limit: Duration,
}

impl Outcome {
    /// Whether it exited with status 0.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    /// `exit status 1`, `killed after 120 s` ...
    pub fn describe(&self) -> String {
        match self.status {
            None => format!("{} did not finish within {} and was killed", self.command, secs(self.limit)),
            Some(s) => match s.code() {
                Some(c) => format!("{} exited with status {c}", self.command),
                None => format!("{} ended by a signal ({s})", self.command),
            },
        }
    }

    /// The last `n` non-empty lines of stderr (then stdout), for a failure's diagnostics.
    pub fn tail(&self, n: usize) -> Vec<String> {
        let text = if self.stderr.trim().is_empty() { &self.stdout } else { &self.stderr };
        let lines: Vec<String> = text.lines().filter(|l| !l.trim().is_empty()).map(|l| l.trim().to_owned()).collect();
        lines[lines.len().saturating_sub(n)..].to_vec()
    }
}

/// A started program.
pub struct Running {
    child: Child,
    command: String,
    start: Instant,
    readers: Vec<std::thread::JoinHandle<String>>,
}

/// Starts `program` with `args`, its output captured.
pub fn spawn(program: &Path, args: &[String]) -> Result<Running, String> {
    let command =
        std::iter::once(program.display().to_string()).chain(args.iter().cloned()).collect::<Vec<_>>().join(" ");
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("PATH", "/usr/bin:/usr/sbin:/bin:/sbin")
        .spawn()
        .map_err(|e| format!("cannot start {command}: {e}"))?;
    let mut readers = Vec::new();
    let out = child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>);
    let err = child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>);
    for mut pipe in [out, err].into_iter().flatten() {
        readers.push(std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            String::from_utf8_lossy(&bytes).into_owned()
        }));
    }
    Ok(Running { child, command, start: Instant::now(), readers })
}

impl Running {
    /// Waits until the program exits or `limit` (from its start) passes; then kills it.
    pub fn wait(mut self, limit: Duration) -> Outcome {
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if self.start.elapsed() < limit => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    // Our own child, by its handle: SIGKILL, then reap it.
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break None;
                }
            }
        };
        let elapsed = self.start.elapsed();
        // A grandchild may still hold the pipes open: give the readers a moment, then
        // leave them rather than hang.
        let until = Instant::now() + Duration::from_secs(2);
        while self.readers.iter().any(|r| !r.is_finished()) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut texts: Vec<String> = self
            .readers
            .into_iter()
            .map(|r| if r.is_finished() { r.join().unwrap_or_default() } else { String::new() })
            .collect();
        let stderr = if texts.len() > 1 { texts.pop().unwrap_or_default() } else { String::new() };
        let stdout = texts.pop().unwrap_or_default();
        Outcome { command: self.command, status, stdout, stderr, elapsed, limit }
    }
}

/// Runs `program` to its end or `limit`.
pub fn run(program: &Path, args: &[String], limit: Duration) -> Result<Outcome, String> {
    Ok(spawn(program, args)?.wait(limit))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Vec<String> {
        vec!["-c".into(), script.into()]
    }

    #[test]
    fn test_output_and_status() {
        let o = run(Path::new("/bin/sh"), &sh("echo out; echo err >&2; exit 3"), Duration::from_secs(10)).unwrap();
        assert_eq!(o.stdout, "out\n");
        assert_eq!(o.stderr, "err\n");
        assert!(!o.success());
        assert_eq!(o.describe(), "/bin/sh -c echo out; echo err >&2; exit 3 exited with status 3");
        assert_eq!(o.tail(5), ["err"]);
    }

    #[test]
    fn test_a_hung_program_is_killed() {
        let start = Instant::now();
        let o = run(Path::new("/bin/sh"), &sh("echo started; exec sleep 30"), Duration::from_millis(300)).unwrap();
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(o.status.is_none());
        assert_eq!(o.stdout, "started\n");
        assert!(o.describe().ends_with("did not finish within 0.3 s and was killed"), "{}", o.describe());
    }

    #[test]
    fn test_a_missing_program_is_an_error() {
        let e = run(Path::new("/nonexistent/gdrvm-verbs"), &[], Duration::from_secs(1)).unwrap_err();
        assert!(e.starts_with("cannot start /nonexistent/gdrvm-verbs: "), "{e}");
    }
}
