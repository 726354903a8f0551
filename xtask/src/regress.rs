//! The regression commands' guests: `cargo xtask test --matrix` (each cell of a matrix
//! boots once) and `cargo xtask bisect` (each candidate a kernel, a command line or a
//! module source, booted until the first bad one is found). Both build the cell's or
//! candidate's image ([`crate::kernel`]); one that cannot be built cannot be tested (125),
//! and the rest runs like `cargo xtask boot`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use gdrvm_harness::ktap::{CaseOutcome, KtapReport};
use gdrvm_harness::{exit, gdrvm_dir, BootImage, Runner, VmResult, VmSpec, Vmm};
use serde::Deserialize;

use crate::bisect::{self, BisectOutcome, BisectPlan, Probe, Verdict, Vote};
use crate::kernel::KernelOpts;
use crate::matrix::{self, Cell, CellReport, Matrix, Shard};

/// What every guest of a run gets apart from its kernel: node, suites, command line, size.
#[derive(Debug, Clone)]
pub struct GuestPlan {
    /// Node preset or file (`None`: the plain node).
    pub node: Option<String>,
    /// Suites to run.
    pub suites: Vec<String>,
    /// Words appended to the kernel command line.
    pub append: String,
    /// vCPUs.
    pub cpus: u32,
    /// RAM.
    pub memory: String,
    /// Seconds before a hung guest is stopped.
    pub timeout: Duration,
}

/// The guest command line that runs `suites`, with `append`.
pub fn suites_cmdline(suites: &[String], append: &str) -> String {
    format!("console=ttyS0 quiet panic=-1 gdrvm.suites={} {append}", suites.join(",")).trim_end().to_owned()
}

impl GuestPlan {
    fn spec(&self, name: &str, image: BootImage) -> VmSpec {
        VmSpec {
            name: name.to_owned(),
            vmm: Vmm::Gdrvm,
            image,
            node: self.node.clone(),
            cluster: None,
            cmdline: suites_cmdline(&self.suites, &self.append),
            cpus: self.cpus,
            memory: self.memory.clone(),
            timeout: self.timeout,
        }
    }
}

/// A report for a cell or candidate that never booted.
fn not_tested(why: String, elapsed: Duration) -> CellReport {
    CellReport {
        exit_code: exit::CANNOT_TEST,
        ktap: KtapReport::default(),
        problem: Some(format!("cannot test: {why}")),
        elapsed,
        console_tail: Vec::new(),
    }
}

/// Boots one guest: its image first (an image that cannot be built is 125), then the run.
async fn boot_one(runner: &Runner, name: &str, kernel: &KernelOpts, plan: &GuestPlan) -> CellReport {
    let started = Instant::now();
    let cmdline = suites_cmdline(&plan.suites, &plan.append);
    let image = if kernel.is_default() {
        Ok(runner.artifacts.guest_for(&cmdline))
    } else {
        let opts = kernel.clone();
        // Downloads and compiles: off the runtime's threads.
        tokio::task::spawn_blocking(move || crate::build::custom_guest(&opts, &cmdline))
            .await
            .unwrap_or_else(|e| Err(anyhow::anyhow!("image build panicked: {e}")))
    };
    let image = match image {
        Ok(image) => image,
        Err(e) => return not_tested(format!("{e:#}"), started.elapsed()),
    };
    let spec = plan.spec(name, image);
    if let Err(e) = spec.validate() {
        return not_tested(e.to_string(), started.elapsed());
    }
    match runner.run(std::slice::from_ref(&spec)).await {
        Ok(results) => match results.first() {
            Some(result) => CellReport::from(result),
            None => not_tested("the runner returned no result".into(), started.elapsed()),
        },
        Err(e) => not_tested(e.to_string(), started.elapsed()),
    }
}

/// Runs the cells of `matrix` (those of `shard`), `lanes` at a time, printing each as it
/// ends; writes JUnit to `junit` and prints the summary and what differs. Returns the exit
/// status: 0 all passed, 1 a cell failed, 125 none failed but some could not test.
pub async fn run_matrix(
    runner: Arc<Runner>,
    matrix: &Matrix,
    shard: Option<Shard>,
    base: &GuestPlan,
    junit: &Path,
) -> Result<i32> {
    let all = matrix.cells();
    let total = all.len();
    let cells = match shard {
        Some(s) => s.select(all),
        None => all,
    };
    let lanes = lanes(runner.kind, base.cpus).min(cells.len().max(1));
    println!(
        "xtask: matrix {}: {} of {total} cells{}, {lanes} at a time",
        matrix.name,
        cells.len(),
        shard.map(|s| format!(" (shard {}/{})", s.index, s.count)).unwrap_or_default()
    );
    let count = cells.len();
    let queue = Arc::new(std::sync::Mutex::new(cells.into_iter().enumerate().collect::<Vec<_>>()));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..lanes {
        let (runner, queue, base) = (runner.clone(), queue.clone(), base.clone());
        set.spawn(async move {
            let mut done = Vec::new();
            loop {
                let next = queue.lock().ok().and_then(|mut q| if q.is_empty() { None } else { Some(q.remove(0)) });
                let Some((i, cell)) = next else { break };
                println!("xtask: matrix: cell {} of {count}: {}: starting", i + 1, cell.name());
                let kernel = KernelOpts {
                    kernel: Some(cell.kernel.clone()),
                    modules: None,
                    module_src: cell.module_src.clone(),
                };
                let plan = GuestPlan {
                    node: Some(cell.node.clone()),
                    suites: cell.suites.clone(),
                    append: [base.append.as_str(), cell.append.as_str()]
                        .join(" ")
                        .replace(ATTEMPT, "0")
                        .trim()
                        .to_owned(),
                    ..base.clone()
                };
                let report = boot_one(&runner, &cell.file_stem(), &kernel, &plan).await;
                let (p, f, s) = report.ktap.counts();
                println!(
                    "xtask: matrix: cell {} of {count}: {}: {} ({p} passed, {f} failed, {s} skipped) in {:.0?}{}",
                    i + 1,
                    cell.name(),
                    report.verdict(),
                    report.elapsed,
                    report.problem.as_ref().map(|p| format!(": {p}")).unwrap_or_default()
                );
                done.push((i, cell, report));
            }
            done
        });
    }
    let mut results = Vec::new();
    while let Some(lane) = set.join_next().await {
        results.extend(lane.context("a matrix lane panicked")?);
    }
    results.sort_by_key(|(i, _, _)| *i);
    let results: Vec<(Cell, CellReport)> = results.into_iter().map(|(_, c, r)| (c, r)).collect();
    if let Some(dir) = junit.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(junit, matrix::junit_cells(&matrix.name, &results))
        .with_context(|| format!("writing {}", junit.display()))?;
    print!("{}", matrix::summary_table(&results));
    let differences = matrix::differences(&results);
    if !differences.is_empty() {
        println!("xtask: matrix: what differs between cells:");
        print!("{differences}");
    }
    println!("xtask: matrix: JUnit in {}", junit.display());
    Ok(matrix::matrix_exit(&results))
}

/// How many guests run at once: nested, each in its own L1 (a QEMU TCG process with two
/// busy vCPU threads), so one per two host cores; native, one per guest's vCPUs.
fn lanes(kind: gdrvm_harness::RunnerKind, cpus: u32) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = match kind {
        gdrvm_harness::RunnerKind::Nested => 2,
        gdrvm_harness::RunnerKind::Native => cpus.max(1) as usize,
    };
    (cores / per).max(1)
}

/// A user's candidate list for `cargo xtask bisect --candidates FILE`, oldest first.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CandidateFile {
    candidate: Vec<CandidateEntry>,
}

/// One candidate: a name and what it changes from the command's own options.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct CandidateEntry {
    name: String,
    /// `debian:<name>`, a kernel path, or unset (the command's --kernel).
    kernel: Option<String>,
    /// Words appended to the command line.
    #[serde(default)]
    append: String,
    /// An out-of-tree module source.
    module_src: Option<PathBuf>,
}

/// Where `cargo xtask bisect` takes its candidates from.
pub enum Candidates {
    /// Every kernel of images/kernels.lock, in version order.
    Kernels,
    /// A TOML file of `[[candidate]]` entries (name, and any of kernel, append, module_src).
    File(PathBuf),
}

fn load_candidates(source: &Candidates) -> Result<Vec<CandidateEntry>> {
    match source {
        Candidates::Kernels => {
            let lock = gdrvm_images::KernelLock::load(&gdrvm_images::lock_path())?;
            let ids = bisect::candidates_from_lock(lock.kernels.iter().map(|k| k.id()).collect());
            Ok(ids
                .into_iter()
                .map(|id| CandidateEntry {
                    name: id.clone(),
                    kernel: Some(id),
                    append: String::new(),
                    module_src: None,
                })
                .collect())
        }
        Candidates::File(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("candidates {}", path.display()))?;
            let file: CandidateFile =
                toml::from_str(&text).with_context(|| format!("candidates {}", path.display()))?;
            let dir = path.parent().unwrap_or(Path::new(""));
            let mut seen = std::collections::HashSet::new();
            let mut out = Vec::new();
            for mut c in file.candidate {
                if c.name.trim().is_empty() || !seen.insert(c.name.clone()) {
                    bail!("candidates {}: candidate.name '{}' is empty or given twice", path.display(), c.name);
                }
                c.module_src = c.module_src.map(|m| if m.is_relative() { dir.join(m) } else { m });
                out.push(c);
            }
            if out.len() < 2 {
                bail!("candidates {}: a bisection needs at least two candidates", path.display());
            }
            Ok(out)
        }
    }
}

/// Which result of a boot is the bisection's test: the whole run (its exit status), or one
/// KTAP test (`suite.case`, or a case name found in any suite).
fn verdict_of(report: &CellReport, test: Option<&str>) -> Verdict {
    let Some(id) = test else {
        let why = report.problem.clone().unwrap_or_else(|| format!("exit {}", report.exit_code));
        return Verdict::from_exit(report.exit_code, &why);
    };
    if report.exit_code == exit::CANNOT_TEST {
        return Verdict::Skip(report.problem.clone().unwrap_or_else(|| "cannot test".into()));
    }
    let (suite, case) = id.split_once('.').map_or((None, id), |(s, c)| (Some(s), c));
    let found = report
        .ktap
        .suites
        .iter()
        .filter(|s| suite.is_none_or(|want| s.name == want))
        .flat_map(|s| &s.cases)
        .find(|c| c.name == case);
    match found.map(|c| &c.outcome) {
        Some(CaseOutcome::Pass) => Verdict::Good,
        Some(CaseOutcome::Fail) => Verdict::Bad,
        Some(CaseOutcome::Skip(why)) => Verdict::Skip(format!("{id} skipped: {why}")),
        None => Verdict::Skip(format!(
            "no KTAP test {id} in the output{}",
            report.problem.as_ref().map(|p| format!(" ({p})")).unwrap_or_default()
        )),
    }
}

/// Boots candidates for the bisection.
struct BootProbe<'a> {
    runner: &'a Runner,
    candidates: &'a [CandidateEntry],
    kernel: &'a KernelOpts,
    plan: &'a GuestPlan,
    test: Option<&'a str>,
    boots: usize,
}

impl Probe for BootProbe<'_> {
    async fn test(&mut self, candidate: &str, attempt: usize) -> Verdict {
        let Some(c) = self.candidates.iter().find(|c| c.name == candidate) else {
            return Verdict::Skip(format!("unknown candidate {candidate}"));
        };
        let kernel = KernelOpts {
            kernel: c.kernel.clone().or_else(|| self.kernel.kernel.clone()),
            modules: self.kernel.modules.clone(),
            module_src: c.module_src.clone().or_else(|| self.kernel.module_src.clone()),
        };
        let append = [self.plan.append.as_str(), &c.append].join(" ").replace(ATTEMPT, &attempt.to_string());
        let plan = GuestPlan { append: append.trim().to_owned(), ..self.plan.clone() };
        println!("xtask: bisect: booting {candidate} (attempt {})", attempt + 1);
        self.boots += 1;
        let report = boot_one(self.runner, "bisect", &kernel, &plan).await;
        verdict_of(&report, self.test)
    }
}

/// Written in a command line, becomes the attempt's number (0, 1, ...) in each boot of a
/// repeated run: a test can tell attempts apart (and a flake be reproduced on purpose).
pub const ATTEMPT: &str = "{attempt}";

/// Boots of one spec for [`boot_repeated`], each reported as it ends.
struct Attempts<'a, R: Fn(&VmResult) -> Result<i32>> {
    runner: &'a Runner,
    spec: &'a VmSpec,
    report: R,
}

impl<R: Fn(&VmResult) -> Result<i32>> Probe for Attempts<'_, R> {
    async fn test(&mut self, _candidate: &str, attempt: usize) -> Verdict {
        let spec = VmSpec { cmdline: self.spec.cmdline.replace(ATTEMPT, &attempt.to_string()), ..self.spec.clone() };
        println!("xtask: attempt {}", attempt + 1);
        let result = match self.runner.run(std::slice::from_ref(&spec)).await {
            Ok(results) => results.into_iter().next(),
            Err(e) => return Verdict::Skip(e.to_string()),
        };
        let Some(result) = result else { return Verdict::Skip("the runner returned no result".into()) };
        match (self.report)(&result) {
            Ok(code) => Verdict::from_exit(code, &result.problem().unwrap_or_else(|| format!("exit {code}"))),
            Err(e) => Verdict::Skip(format!("{e:#}")),
        }
    }
}

/// Boots `spec` up to `repeat` times (odd; `{attempt}` in its command line numbered) and
/// returns the majority's exit status: 0, 1, or 125 when there is none (every attempt
/// untestable, or as many passes as failures among the testable ones).
pub async fn boot_repeated(
    runner: &Runner,
    spec: &VmSpec,
    repeat: usize,
    report: impl Fn(&VmResult) -> Result<i32>,
) -> Result<i32> {
    let vote = Vote::new(repeat)?;
    let mut attempts = Attempts { runner, spec, report };
    let ballot = vote.decide(&mut attempts, &spec.name).await;
    let tally: Vec<String> = ballot.attempts.iter().map(|v| v.to_string()).collect();
    println!("xtask: {} attempt(s): {}; the majority: {}", ballot.attempts.len(), tally.join(", "), ballot.verdict);
    Ok(match ballot.verdict {
        Verdict::Good => exit::PASS,
        Verdict::Bad => exit::FAIL,
        Verdict::Skip(_) => exit::CANNOT_TEST,
    })
}

/// What `cargo xtask bisect` was asked.
pub struct BisectArgs {
    /// Where the candidates come from.
    pub candidates: Candidates,
    /// The last known good candidate.
    pub good: String,
    /// The first known bad one.
    pub bad: String,
    /// One KTAP test (`suite.case`) instead of the whole run.
    pub test: Option<String>,
    /// Boots per candidate (odd): the majority decides.
    pub repeat: usize,
    /// Boot the ends too, and stop if they are not good and bad.
    pub verify_ends: bool,
}

/// Bisects: prints each step as it ends and the first bad candidate. Exit 0 when one was
/// named, 1 when the ends were wrong, 125 when skipped candidates hide the answer.
pub async fn run_bisect(runner: &Runner, args: &BisectArgs, kernel: &KernelOpts, plan: &GuestPlan) -> Result<i32> {
    let candidates = load_candidates(&args.candidates)?;
    let names: Vec<String> = candidates.iter().map(|c| c.name.clone()).collect();
    let good = bisect::find(&names, &args.good).context("--good")?;
    let bad = bisect::find(&names, &args.bad).context("--bad")?;
    let bisect_plan = BisectPlan { good, bad, vote: Vote::new(args.repeat)?, verify_ends: args.verify_ends };
    println!(
        "xtask: bisect: {} candidates from {} (good) to {} (bad); at most {} steps of up to {} boot(s)",
        bad.saturating_sub(good) + 1,
        names[good],
        names[bad],
        bisect::max_steps(bad.saturating_sub(good) + 1) + if args.verify_ends { 2 } else { 0 },
        args.repeat
    );
    let mut probe = BootProbe { runner, candidates: &candidates, kernel, plan, test: args.test.as_deref(), boots: 0 };
    let mut log = |step: &bisect::Step| println!("xtask: bisect: {step}");
    let result = bisect::bisect(&names, &bisect_plan, &mut probe, &mut log).await?;
    let boots = probe.boots;
    println!("xtask: bisect: {} ({} steps, {boots} boots)", result.outcome, result.steps.len());
    write_log(&result)?;
    Ok(match result.outcome {
        BisectOutcome::FirstBad { .. } => exit::PASS,
        BisectOutcome::Range { .. } => exit::CANNOT_TEST,
        BisectOutcome::EndsWrong(_) => exit::FAIL,
    })
}

/// Keeps the steps in target/gdrvm/results/bisect.log.
fn write_log(result: &bisect::Bisection) -> Result<()> {
    let dir = gdrvm_dir().join("results");
    std::fs::create_dir_all(&dir)?;
    let mut text: String = result.steps.iter().map(|s| format!("{s}\n")).collect();
    text.push_str(&format!("{}\n", result.outcome));
    let path = dir.join("bisect.log");
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    println!("xtask: bisect: log in {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use gdrvm_harness::ktap;

    use super::*;

    fn report(code: i32, console: &str) -> CellReport {
        CellReport {
            exit_code: code,
            ktap: ktap::parse(console),
            problem: None,
            elapsed: Duration::ZERO,
            console_tail: Vec::new(),
        }
    }

    const KTAP: &str = "KTAP version 1\n1..1\n    KTAP version 1\n    # Subtest: topology\n    1..2\n    ok 1 numa_nodes\n    not ok 2 gdr_paths\nnot ok 1 topology\n";

    #[test]
    fn test_verdict_of_the_run_and_of_one_test() {
        assert_eq!(verdict_of(&report(0, ""), None), Verdict::Good);
        assert_eq!(verdict_of(&report(1, KTAP), None), Verdict::Bad);
        assert!(matches!(verdict_of(&report(125, ""), None), Verdict::Skip(_)));
        assert_eq!(verdict_of(&report(1, KTAP), Some("topology.numa_nodes")), Verdict::Good);
        assert_eq!(verdict_of(&report(1, KTAP), Some("gdr_paths")), Verdict::Bad);
        assert!(
            matches!(verdict_of(&report(1, KTAP), Some("smoke.numa_nodes")), Verdict::Skip(w) if w.contains("no KTAP test"))
        );
        assert!(matches!(verdict_of(&report(125, KTAP), Some("numa_nodes")), Verdict::Skip(_)));
    }

    #[test]
    fn test_candidate_files_resolve_and_reject_bad_lists() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "[[candidate]]\nname = \"a\"\n[[candidate]]\nname = \"b\"\nappend = \"numa=off\"\nmodule_src = \"drv\"\n",
        )
        .unwrap();
        let c = load_candidates(&Candidates::File(path.clone())).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c[1].append, "numa=off");
        assert_eq!(c[1].module_src.as_deref(), Some(dir.path().join("drv").as_path()));
        std::fs::write(&path, "[[candidate]]\nname = \"a\"\n[[candidate]]\nname = \"a\"\n").unwrap();
        let e = format!("{:#}", load_candidates(&Candidates::File(path.clone())).unwrap_err());
        assert!(e.contains("given twice") && e.contains("c.toml"), "{e}");
        std::fs::write(&path, "[[candidate]]\nname = \"a\"\nkernal = \"x\"\n").unwrap();
        let e = format!("{:#}", load_candidates(&Candidates::File(path)).unwrap_err());
        assert!(e.contains("kernal"), "{e}");
    }

    #[test]
    fn test_lock_candidates_are_the_kernels_in_order() {
        let c = load_candidates(&Candidates::Kernels).unwrap();
        assert!(c.len() >= 2);
        assert!(c.windows(2).all(|w| gdrvm_images::kernel_order(&w[0].name, &w[1].name).is_lt()));
        assert!(c.iter().all(|k| k.kernel.as_deref() == Some(k.name.as_str())));
    }
}
