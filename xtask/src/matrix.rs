//! Test matrices: a TOML file of axes (kernels, nodes, kernel command-line variants,
//! out-of-tree module sources, suites) whose cartesian product is the cells that
//! `cargo xtask test --matrix` boots once each; CI shards (`--shard I/N`); JUnit XML with one
//! testsuite per cell; a summary table and what differs between cells; and merging the JUnit
//! files of several shards into one.
//!
//! The JUnit written here validates against the Jenkins JUnit schema (`jenkins-junit.xsd`,
//! the one JUnit 5 checks its own reports with): it allows no `skipped` count on
//! `<testsuites>` and no attributes on `<skipped>`, so the root has none and a skip's reason
//! is the element's text.

use std::collections::{HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use gdrvm_harness::junit::escape;
use gdrvm_harness::ktap::{CaseOutcome, KtapReport};
use gdrvm_harness::{exit, VmResult};
use serde::Deserialize;

/// A matrix file as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MatrixFile {
    name: Option<String>,
    axes: AxesFile,
    /// Cells beyond the product of the axes (as GitHub Actions' `matrix.include`).
    #[serde(default)]
    include: Vec<IncludeFile>,
    #[serde(default)]
    run: RunSettings,
}

/// One `[[include]]` cell as written: a node, and what differs from the default.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IncludeFile {
    kernel: Option<String>,
    node: String,
    #[serde(default)]
    append: String,
    module_src: Option<String>,
    suites: Option<String>,
}

/// One extra cell: every field as for an axis value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Include {
    /// Kernel (`default` when left out).
    pub kernel: String,
    /// Node preset or file.
    pub node: String,
    /// Command-line words.
    pub append: String,
    /// Module source.
    pub module_src: Option<PathBuf>,
    /// Suites (`smoke` when left out).
    pub suites: Vec<String>,
}

/// `[axes]` as written; `None` is a key left out.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AxesFile {
    kernels: Option<Vec<String>>,
    nodes: Vec<String>,
    append: Option<Vec<String>>,
    #[serde(default)]
    module_src: Vec<String>,
    suites: Option<Vec<String>>,
}

/// `[run]`: the size and timeout of every cell's guest; what is unset takes the command's
/// defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSettings {
    /// vCPUs of each guest.
    pub cpus: Option<u32>,
    /// Guest RAM (e.g. "1G").
    pub memory: Option<String>,
    /// Seconds before a hung guest is stopped.
    pub timeout: Option<u64>,
}

/// A checked matrix: every axis has at least one value and no value twice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matrix {
    /// Its name (the file's `name`, else the file stem): the JUnit `<testsuites>` name.
    pub name: String,
    /// Kernels: `default` (the recipe's), `debian:<release>`, or a path.
    pub kernels: Vec<String>,
    /// Node presets or node files.
    pub nodes: Vec<String>,
    /// Kernel command-line variants (`""`: nothing appended).
    pub append: Vec<String>,
    /// Out-of-tree module source directories; empty: none.
    pub module_src: Vec<PathBuf>,
    /// Suite lists, one per cell.
    pub suites: Vec<Vec<String>>,
    /// Cells beyond the product, after it.
    pub include: Vec<Include>,
    /// Guest size and timeout.
    pub run: RunSettings,
}

/// One combination of the axes: one boot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cell {
    /// Position in [`Matrix::cells`], from 0.
    pub index: usize,
    /// Kernel (as in [`Matrix::kernels`]).
    pub kernel: String,
    /// Node preset or file.
    pub node: String,
    /// Kernel command-line words to append (may be empty).
    pub append: String,
    /// Out-of-tree module source directory, if the matrix has that axis.
    pub module_src: Option<PathBuf>,
    /// Suites to run.
    pub suites: Vec<String>,
    /// See [`Cell::name`].
    name: String,
}

impl Matrix {
    /// Reads and checks the matrix file at `path`. Relative paths in it (kernel and node
    /// files, module sources) are taken from the file's directory. Errors name the file, the
    /// key and the reason.
    pub fn load(path: &Path) -> Result<Matrix> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("matrix {}: cannot be read", path.display()))?;
        Matrix::parse(&text, path)
    }

    /// [`Matrix::load`] of `text`, read from `path`.
    fn parse(text: &str, path: &Path) -> Result<Matrix> {
        let shown = path.display();
        let file: MatrixFile = toml::from_str(text).with_context(|| format!("matrix {shown}"))?;
        let dir = path.parent().unwrap_or(Path::new(""));
        let axes = file.axes;
        let name = match file.name {
            Some(name) if name.trim().is_empty() => bail!("matrix {shown}: name: empty"),
            Some(name) => name,
            None => path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "matrix".into()),
        };
        let kernels = axis(path, "kernels", axes.kernels.unwrap_or_else(|| vec!["default".into()]))?;
        for kernel in &kernels {
            if kernel.is_empty() || kernel.strip_prefix("debian:").is_some_and(str::is_empty) {
                bail!("matrix {shown}: axes.kernels: '{kernel}' names no kernel (default, debian:<release> or a path)");
            }
        }
        let nodes = axis(path, "nodes", axes.nodes)?;
        if nodes.iter().any(String::is_empty) {
            bail!("matrix {shown}: axes.nodes: an empty name (a preset or a node file)");
        }
        let append = axis(path, "append", axes.append.unwrap_or_else(|| vec![String::new()]))?;
        let module_src =
            if axes.module_src.is_empty() { Vec::new() } else { axis(path, "module_src", axes.module_src)? };
        if module_src.iter().any(String::is_empty) {
            bail!("matrix {shown}: axes.module_src: an empty path");
        }
        let mut suites = Vec::new();
        for list in axis(path, "suites", axes.suites.unwrap_or_else(|| vec!["smoke".into()]))? {
            let split: Vec<String> = list.split(',').map(|s| s.trim().to_owned()).collect();
            if split.iter().any(String::is_empty) {
                bail!("matrix {shown}: axes.suites: '{list}' has an empty suite name (write \"a,b\")");
            }
            if suites.contains(&split) {
                bail!("matrix {shown}: axes.suites: '{list}' is given twice");
            }
            suites.push(split);
        }
        if file.run.cpus == Some(0) {
            bail!("matrix {shown}: run.cpus: must be at least 1");
        }
        if file.run.timeout == Some(0) {
            bail!("matrix {shown}: run.timeout: must be at least 1 second");
        }
        let mut include = Vec::new();
        for (i, inc) in file.include.into_iter().enumerate() {
            let key = format!("include[{i}]");
            let kernel = inc.kernel.unwrap_or_else(|| "default".into());
            if kernel.is_empty() || inc.node.is_empty() {
                bail!("matrix {shown}: {key}: kernel and node must not be empty");
            }
            let suites: Vec<String> =
                inc.suites.as_deref().unwrap_or("smoke").split(',').map(|s| s.trim().to_owned()).collect();
            if suites.iter().any(String::is_empty) {
                bail!("matrix {shown}: {key}.suites: an empty suite name (write \"a,b\")");
            }
            include.push(Include {
                kernel: if is_kernel_path(&kernel) { resolve(dir, &kernel) } else { kernel },
                node: if is_node_file(&inc.node) { resolve(dir, &inc.node) } else { inc.node },
                append: inc.append,
                module_src: inc.module_src.map(|m| PathBuf::from(resolve(dir, &m))),
                suites,
            });
        }
        Ok(Matrix {
            include,
            name,
            kernels: kernels.into_iter().map(|k| if is_kernel_path(&k) { resolve(dir, &k) } else { k }).collect(),
            nodes: nodes.into_iter().map(|n| if is_node_file(&n) { resolve(dir, &n) } else { n }).collect(),
            append,
            module_src: module_src.iter().map(|m| PathBuf::from(resolve(dir, m))).collect(),
            suites,
            run: file.run,
        })
    }

    /// The cartesian product of the axes: kernels outermost, then nodes, append, module
    /// sources, suites. The order (and so each cell's index) is stable for a given file.
    pub fn cells(&self) -> Vec<Cell> {
        let modules: Vec<Option<PathBuf>> =
            if self.module_src.is_empty() { vec![None] } else { self.module_src.iter().cloned().map(Some).collect() };
        let kernel_labels = labels(&self.kernels, kernel_label);
        let node_labels = labels(&self.nodes, node_label);
        let module_texts: Vec<String> = self.module_src.iter().map(|m| m.display().to_string()).collect();
        let module_labels = labels(&module_texts, file_label);
        let mut cells = Vec::new();
        for (kernel, kernel_label) in self.kernels.iter().zip(&kernel_labels) {
            for (node, node_label) in self.nodes.iter().zip(&node_labels) {
                for append in &self.append {
                    for (m, module) in modules.iter().enumerate() {
                        for suites in &self.suites {
                            let mut name = format!("{kernel_label}/{node_label}/{}", suites.join(","));
                            if self.append.len() > 1 && !append.is_empty() {
                                let _ = write!(name, "+{append}");
                            }
                            if self.module_src.len() > 1 {
                                let _ = write!(name, "+{}", module_labels[m]);
                            }
                            cells.push(Cell {
                                index: cells.len(),
                                kernel: kernel.clone(),
                                node: node.clone(),
                                append: append.clone(),
                                module_src: module.clone(),
                                suites: suites.clone(),
                                name,
                            });
                        }
                    }
                }
            }
        }
        for inc in &self.include {
            let mut name = format!("{}/{}/{}", kernel_label(&inc.kernel), node_label(&inc.node), inc.suites.join(","));
            if !inc.append.is_empty() {
                let _ = write!(name, "+{}", inc.append);
            }
            if let Some(m) = &inc.module_src {
                let _ = write!(name, "+{}", file_label(&m.display().to_string()));
            }
            cells.push(Cell {
                index: cells.len(),
                kernel: inc.kernel.clone(),
                node: inc.node.clone(),
                append: inc.append.clone(),
                module_src: inc.module_src.clone(),
                suites: inc.suites.clone(),
                name,
            });
        }
        // Labels are unique per axis, but a path's '/' can still make two names alike.
        let mut seen: HashMap<String, usize> = HashMap::new();
        for cell in &cells {
            *seen.entry(cell.name.clone()).or_default() += 1;
        }
        for cell in &mut cells {
            if seen[&cell.name] > 1 {
                cell.name = format!("{}#{}", cell.name, cell.index + 1);
            }
        }
        cells
    }
}

/// Checks one axis: at least one value, none twice.
fn axis(path: &Path, key: &str, values: Vec<String>) -> Result<Vec<String>> {
    if values.is_empty() {
        bail!("matrix {}: axes.{key}: empty; give at least one value (or leave the key out)", path.display());
    }
    let mut seen = HashSet::new();
    for value in &values {
        if !seen.insert(value) {
            bail!("matrix {}: axes.{key}: '{value}' is given twice", path.display());
        }
    }
    Ok(values)
}

/// A kernel value that is a path (not `default`, not `debian:...`).
fn is_kernel_path(kernel: &str) -> bool {
    kernel != "default" && !kernel.starts_with("debian:")
}

/// A node value that is a node file rather than a preset.
fn is_node_file(node: &str) -> bool {
    node.contains('/') || node.ends_with(".toml")
}

/// `value` taken from `dir` when relative.
fn resolve(dir: &Path, value: &str) -> String {
    if Path::new(value).is_relative() {
        dir.join(value).display().to_string()
    } else {
        value.to_owned()
    }
}

/// Short labels of an axis's values for cell names, or the values themselves where two
/// short labels would be alike.
fn labels(values: &[String], short: fn(&str) -> String) -> Vec<String> {
    let shorts: Vec<String> = values.iter().map(|v| short(v)).collect();
    let unique: HashSet<&String> = shorts.iter().collect();
    if unique.len() == shorts.len() {
        shorts
    } else {
        values.to_vec()
    }
}

/// `debian:6.1.0-47` → `6.1.0-47`; a path → its file name.
fn kernel_label(kernel: &str) -> String {
    match kernel.strip_prefix("debian:") {
        Some(release) => release.to_owned(),
        None if kernel == "default" => kernel.to_owned(),
        None => file_label(kernel),
    }
}

/// A preset → itself; a node file → its stem.
fn node_label(node: &str) -> String {
    if is_node_file(node) {
        Path::new(node).file_stem().map_or_else(|| node.to_owned(), |s| s.to_string_lossy().into_owned())
    } else {
        node.to_owned()
    }
}

/// A path's last component.
fn file_label(path: &str) -> String {
    Path::new(path).file_name().map_or_else(|| path.to_owned(), |s| s.to_string_lossy().into_owned())
}

/// Longest sanitized name kept in [`Cell::file_stem`].
const FILE_STEM_MAX: usize = 160;

impl Cell {
    /// A short id, unique in its matrix: `<kernel>/<node>/<suites>`, then `+<append>` and
    /// `+<module dir>` when those axes have more than one value, e.g.
    /// `6.1.0-47/vela-a100/smoke+pci=noats`. The JUnit testsuite name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A file name stem for this cell's results: its 1-based index and its name with
    /// anything but `[A-Za-z0-9._+=,-]` turned into `_` (e.g. `003-6.1.0-48_vela-a100_smoke`).
    /// Unique in the matrix through the index.
    pub fn file_stem(&self) -> String {
        let safe: String = self
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || "._+=,-".contains(c) { c } else { '_' })
            .take(FILE_STEM_MAX)
            .collect();
        format!("{:03}-{safe}", self.index + 1)
    }
}

/// A CI shard: `I/N` runs the cells whose index is I-1 modulo N.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// I, from 1.
    pub index: usize,
    /// N, at least 1.
    pub count: usize,
}

impl FromStr for Shard {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Shard> {
        let (i, n) = s.split_once('/').with_context(|| format!("shard '{s}': expected I/N, e.g. 1/4"))?;
        let number = |part: &str, what: &str| -> Result<usize> {
            part.trim().parse().with_context(|| format!("shard '{s}': {what} '{part}' is not a whole number"))
        };
        let (index, count) = (number(i, "I")?, number(n, "N")?);
        if count == 0 {
            bail!("shard '{s}': N must be at least 1");
        }
        if index == 0 || index > count {
            bail!("shard '{s}': I must be from 1 to N ({count})");
        }
        Ok(Shard { index, count })
    }
}

impl Shard {
    /// The cells of this shard: every N-th, starting at the (I-1)-th. The shards 1/N..N/N
    /// of one matrix partition its cells.
    pub fn select(&self, cells: Vec<Cell>) -> Vec<Cell> {
        cells.into_iter().filter(|c| c.index % self.count == self.index - 1).collect()
    }
}

/// What one cell's boot produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellReport {
    /// 0 passed, 1 failed, 125 (or anything else) could not test.
    pub exit_code: i32,
    /// The guest's KTAP.
    pub ktap: KtapReport,
    /// A sentence for what went wrong at the VM level (or before: no package, no module).
    pub problem: Option<String>,
    /// Wall time of the cell.
    pub elapsed: Duration,
    /// The last console lines, kept for a cell with a problem.
    pub console_tail: Vec<String>,
}

impl From<&VmResult> for CellReport {
    fn from(result: &VmResult) -> CellReport {
        CellReport {
            exit_code: result.exit_code(),
            ktap: result.ktap.clone(),
            problem: result.problem(),
            elapsed: result.elapsed,
            console_tail: result.tail().to_vec(),
        }
    }
}

/// A cell's overall result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every check passed.
    Pass,
    /// A check failed, or the guest panicked or hung.
    Fail,
    /// Nothing could be tested.
    CannotTest,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::CannotTest => "CANNOT TEST",
        })
    }
}

impl CellReport {
    /// PASS for exit 0, FAIL for 1, CANNOT TEST otherwise (125, or 2 for a usage error).
    pub fn verdict(&self) -> Verdict {
        match self.exit_code {
            exit::PASS => Verdict::Pass,
            exit::FAIL => Verdict::Fail,
            _ => Verdict::CannotTest,
        }
    }

    /// The run-level error to report as a `boot` testcase, if there is one: a problem, a cell
    /// that could not test, or one that failed without a failing KTAP check.
    fn boot_error(&self) -> Option<String> {
        let failed_checks = self.ktap.counts().1;
        match (&self.problem, self.verdict()) {
            (Some(problem), _) => Some(problem.clone()),
            (None, Verdict::CannotTest) => Some(format!("could not test (exit {})", self.exit_code)),
            (None, Verdict::Fail) if failed_checks == 0 => {
                Some(format!("failed (exit {}) without a failing KTAP check", self.exit_code))
            }
            _ => None,
        }
    }
}

/// JUnit counts of some testsuites.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Totals {
    tests: usize,
    failures: usize,
    errors: usize,
    skipped: usize,
    /// Seconds.
    time: f64,
}

impl Totals {
    fn add(&mut self, other: &Totals) {
        self.tests += other.tests;
        self.failures += other.failures;
        self.errors += other.errors;
        self.skipped += other.skipped;
        self.time += other.time;
    }

    /// The `<testsuites>` element's start tag (the schema has no `skipped` there).
    fn root_tag(&self, name: &str) -> String {
        format!(
            "<testsuites name=\"{}\" tests=\"{}\" failures=\"{}\" errors=\"{}\" time=\"{:.3}\">",
            escape(name),
            self.tests,
            self.failures,
            self.errors,
            self.time
        )
    }
}

/// The JUnit document of a matrix run called `matrix_name`: one `<testsuite>` per cell
/// (named by [`Cell::name`], with the cell's axes as properties), one `<testcase>` per KTAP
/// check (classname `<cell>.<suite>`), and a `boot` testcase holding the error and the
/// console tail of a cell that could not test or had a problem.
pub fn junit_cells(matrix_name: &str, results: &[(Cell, CellReport)]) -> String {
    let mut total = Totals::default();
    let mut suites = String::new();
    for (cell, report) in results {
        total.add(&cell_suite(&mut suites, cell, report));
    }
    format!("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n{}\n{suites}</testsuites>\n", total.root_tag(matrix_name))
}

/// Writes one cell's `<testsuite>` into `out`; returns its counts.
fn cell_suite(out: &mut String, cell: &Cell, report: &CellReport) -> Totals {
    let (_, failures, skipped) = report.ktap.counts();
    let boot_error = report.boot_error();
    let checks: usize = report.ktap.suites.iter().map(|s| s.cases.len()).sum();
    let totals = Totals {
        tests: checks + usize::from(boot_error.is_some()),
        failures,
        errors: usize::from(boot_error.is_some()),
        skipped,
        time: report.elapsed.as_secs_f64(),
    };
    let name = escape(&cell.name);
    let _ = writeln!(
        out,
        "  <testsuite name=\"{name}\" tests=\"{}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\" time=\"{:.3}\">",
        totals.tests, totals.failures, totals.errors, totals.skipped, totals.time
    );
    out.push_str("    <properties>\n");
    let module = cell.module_src.as_ref().map(|m| m.display().to_string());
    let properties = [
        ("kernel", Some(cell.kernel.clone())),
        ("node", Some(cell.node.clone())),
        ("append", Some(cell.append.clone())),
        ("module_src", module),
        ("suites", Some(cell.suites.join(","))),
        ("exit_code", Some(report.exit_code.to_string())),
    ];
    for (key, value) in properties {
        if let Some(value) = value {
            let _ = writeln!(out, "      <property name=\"{key}\" value=\"{}\"/>", escape(&value));
        }
    }
    out.push_str("    </properties>\n");
    if let Some(error) = &boot_error {
        let mut text = error.clone();
        if !report.console_tail.is_empty() {
            let _ = write!(
                text,
                "\n\nlast {} console lines:\n{}",
                report.console_tail.len(),
                report.console_tail.join("\n")
            );
        }
        let _ = writeln!(
            out,
            "    <testcase classname=\"{name}\" name=\"boot\" time=\"{:.3}\"><error message=\"{}\">{}</error></testcase>",
            totals.time,
            escape(error),
            escape(&text)
        );
    }
    for suite in &report.ktap.suites {
        let classname = format!("{}.{}", cell.name, suite.name);
        for case in &suite.cases {
            gdrvm_harness::junit::write_testcase(out, &classname, case);
        }
    }
    out.push_str("  </testsuite>\n");
    totals
}

/// One row per cell (name, verdict, passed, failed and skipped checks, time) in aligned
/// columns, then a line of totals.
pub fn summary_table(results: &[(Cell, CellReport)]) -> String {
    let width = results.iter().map(|(c, _)| c.name.len()).chain(["cell".len()]).max().unwrap_or(0);
    let mut out = format!(
        "{:<width$}  {:<11}  {:>6}  {:>6}  {:>7}  {:>8}\n",
        "cell", "verdict", "passed", "failed", "skipped", "time"
    );
    let mut checks = (0, 0, 0);
    let mut verdicts = (0, 0, 0);
    let mut time = Duration::ZERO;
    for (cell, report) in results {
        let (p, f, s) = report.ktap.counts();
        let verdict = report.verdict();
        let _ = writeln!(
            out,
            "{:<width$}  {verdict:<11}  {p:>6}  {f:>6}  {s:>7}  {:>7.1}s",
            cell.name,
            report.elapsed.as_secs_f64()
        );
        checks = (checks.0 + p, checks.1 + f, checks.2 + s);
        match verdict {
            Verdict::Pass => verdicts.0 += 1,
            Verdict::Fail => verdicts.1 += 1,
            Verdict::CannotTest => verdicts.2 += 1,
        }
        time += report.elapsed;
    }
    let _ = writeln!(
        out,
        "total: {} cells: {} PASS, {} FAIL, {} CANNOT TEST; checks: {} passed, {} failed, {} skipped; {:.1}s",
        results.len(),
        verdicts.0,
        verdicts.1,
        verdicts.2,
        checks.0,
        checks.1,
        checks.2,
        time.as_secs_f64()
    );
    out
}

/// Each outcome of one check (`ok`, `FAIL`, `skip`) with the names of the cells that had it.
type Outcomes<'a> = Vec<(&'static str, Vec<&'a str>)>;

/// For each KTAP check (`suite.case`) whose outcome is not the same in every cell that ran
/// it, one line: the check, then each outcome (`ok`, `FAIL`, `skip`) with the cells that had
/// it. Empty when every check agrees everywhere.
pub fn differences(results: &[(Cell, CellReport)]) -> String {
    // Check id → (outcome → cells), both in first-seen order.
    let mut checks: Vec<(String, Outcomes)> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    for (cell, report) in results {
        for suite in &report.ktap.suites {
            for case in &suite.cases {
                let id = format!("{}.{}", suite.name, case.name);
                let outcome = match case.outcome {
                    CaseOutcome::Pass => "ok",
                    CaseOutcome::Fail => "FAIL",
                    CaseOutcome::Skip(_) => "skip",
                };
                let i = *at.entry(id.clone()).or_insert_with(|| {
                    checks.push((id, Vec::new()));
                    checks.len() - 1
                });
                let outcomes = &mut checks[i].1;
                match outcomes.iter_mut().find(|(o, _)| *o == outcome) {
                    Some((_, cells)) => cells.push(&cell.name),
                    None => outcomes.push((outcome, vec![&cell.name])),
                }
            }
        }
    }
    checks.retain(|(_, outcomes)| outcomes.len() > 1);
    let width = checks.iter().map(|(id, _)| id.len()).max().unwrap_or(0);
    let mut out = String::new();
    for (id, outcomes) in &checks {
        let parts: Vec<String> =
            outcomes.iter().map(|(outcome, cells)| format!("{outcome} on {}", cells.join(", "))).collect();
        let _ = writeln!(out, "{id:<width$}  {}", parts.join("; "));
    }
    out
}

/// Joins JUnit files (from [`junit_cells`], or any with a `<testsuites>` or a bare
/// `<testsuite>` root) into one `<testsuites>` document. Each testsuite is copied verbatim;
/// the root's counts are recomputed from the testcases (and the suites' times). The root is
/// named as the inputs' roots when they all agree (shards of one matrix), else `merged`.
pub fn merge(inputs: &[PathBuf]) -> Result<String> {
    if inputs.is_empty() {
        bail!("no JUnit files to merge");
    }
    let mut total = Totals::default();
    let mut body = String::new();
    let mut names = HashSet::new();
    for path in inputs {
        let shown = path.display();
        let text = std::fs::read_to_string(path).with_context(|| format!("{shown}: cannot be read"))?;
        let doc = roxmltree::Document::parse(&text).with_context(|| format!("{shown}: not well-formed XML"))?;
        let root = doc.root_element();
        let suites: Vec<roxmltree::Node> = match root.tag_name().name() {
            "testsuites" => {
                names.insert(root.attribute("name").unwrap_or("merged").to_owned());
                root.children().filter(|n| n.has_tag_name("testsuite")).collect()
            }
            "testsuite" => {
                names.insert("merged".to_owned());
                vec![root]
            }
            other => bail!("{shown}: the root element is <{other}>, not <testsuites> or <testsuite>"),
        };
        for suite in suites {
            total.add(&suite_totals(suite).with_context(|| format!("{shown}"))?);
            let _ = writeln!(body, "  {}", &text[suite.range()]);
        }
    }
    let name = match names.len() {
        1 => names.into_iter().next().unwrap_or_default(),
        _ => "merged".to_owned(),
    };
    Ok(format!("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n{}\n{body}</testsuites>\n", total.root_tag(&name)))
}

/// Counts of one `<testsuite>` from its testcases; its time from its `time` attribute.
fn suite_totals(suite: roxmltree::Node) -> Result<Totals> {
    let mut totals = Totals::default();
    for case in suite.descendants().filter(|n| n.has_tag_name("testcase")) {
        let has = |tag: &str| case.children().any(|n| n.has_tag_name(tag));
        totals.tests += 1;
        totals.failures += usize::from(has("failure"));
        totals.errors += usize::from(has("error"));
        totals.skipped += usize::from(has("skipped"));
    }
    if let Some(time) = suite.attribute("time") {
        totals.time = time.trim().parse().ok().filter(|t: &f64| t.is_finite() && *t >= 0.0).with_context(|| {
            format!("testsuite '{}': time '{time}' is not a number of seconds", suite.attribute("name").unwrap_or(""))
        })?;
    }
    Ok(totals)
}

/// The exit status of a matrix run: 0 every cell passed (or there were none: an empty
/// shard), 1 a cell failed, 125 none failed but some could not test.
pub fn matrix_exit(results: &[(Cell, CellReport)]) -> i32 {
    let verdicts: Vec<Verdict> = results.iter().map(|(_, r)| r.verdict()).collect();
    if verdicts.contains(&Verdict::Fail) {
        exit::FAIL
    } else if verdicts.contains(&Verdict::CannotTest) {
        exit::CANNOT_TEST
    } else {
        exit::PASS
    }
}

#[cfg(test)]
mod tests {
    use gdrvm_harness::{ktap, VmOutcome};

    use super::*;

    fn parse(text: &str) -> Result<Matrix> {
        Matrix::parse(text, Path::new("/m/x.toml"))
    }

    fn err(text: &str) -> String {
        format!("{:#}", parse(text).expect_err(text))
    }

    #[test]
    fn test_load_reads_axes_and_defaults() {
        let m = parse(
            r#"
            name = "k"
            [axes]
            kernels = ["debian:6.1.0-47", "debian:6.12.117+deb12", "build/bzImage"]
            nodes = ["vela-a100", "nodes/lab.toml"]
            append = ["", "pci=noats"]
            module_src = ["drv", "/abs/drv2"]
            suites = ["smoke", "smoke, topology"]
            [run]
            cpus = 2
            memory = "1G"
            timeout = 300
            "#,
        )
        .unwrap();
        assert_eq!(m.name, "k");
        assert_eq!(m.kernels, ["debian:6.1.0-47", "debian:6.12.117+deb12", "/m/build/bzImage"]);
        assert_eq!(m.nodes, ["vela-a100", "/m/nodes/lab.toml"]);
        assert_eq!(m.append, ["", "pci=noats"]);
        assert_eq!(m.module_src, [PathBuf::from("/m/drv"), PathBuf::from("/abs/drv2")]);
        assert_eq!(m.suites, [vec!["smoke"], vec!["smoke", "topology"]]);
        assert_eq!(m.run, RunSettings { cpus: Some(2), memory: Some("1G".into()), timeout: Some(300) });

        let m = parse("[axes]\nnodes = [\"minimal\"]\n").unwrap();
        assert_eq!(m.name, "x");
        assert_eq!(m.kernels, ["default"]);
        assert_eq!(m.append, [""]);
        assert!(m.module_src.is_empty());
        assert_eq!(m.suites, [vec!["smoke"]]);
        assert_eq!(m.run, RunSettings::default());
        assert_eq!(m.cells().len(), 1);
        assert_eq!(m.cells()[0].module_src, None);
    }

    #[test]
    fn test_load_errors_name_file_key_and_reason() {
        for (text, words) in [
            ("[axes]\nnodes = [\"a\"]\nkernel = [\"x\"]\n", &["/m/x.toml", "unknown field", "kernel"][..]),
            ("nme = \"x\"\n[axes]\nnodes = [\"a\"]\n", &["/m/x.toml", "unknown field", "nme"]),
            ("[axes]\nnodes = [\"a\"]\n[run]\ncpu = 1\n", &["/m/x.toml", "unknown field", "cpu"]),
            ("[axes]\nkernels = [\"debian:1\"]\n", &["/m/x.toml", "missing field", "nodes"]),
            ("[axes]\nnodes = []\n", &["/m/x.toml", "axes.nodes", "empty"]),
            ("[axes]\nnodes = [\"a\"]\nkernels = []\n", &["axes.kernels", "empty"]),
            ("[axes]\nnodes = [\"a\"]\nappend = []\n", &["axes.append", "empty"]),
            ("[axes]\nnodes = [\"a\"]\nsuites = []\n", &["axes.suites", "empty"]),
            ("[axes]\nnodes = [\"a\", \"b\", \"a\"]\n", &["/m/x.toml", "axes.nodes", "'a' is given twice"]),
            (
                "[axes]\nnodes = [\"a\"]\nsuites = [\"smoke,topology\", \"smoke, topology\"]\n",
                &["axes.suites", "twice"],
            ),
            ("[axes]\nnodes = [\"a\"]\nsuites = [\"smoke,\"]\n", &["axes.suites", "empty suite name"]),
            ("[axes]\nnodes = [\"a\"]\nkernels = [\"debian:\"]\n", &["axes.kernels", "names no kernel"]),
            ("[axes]\nnodes = [\"\"]\n", &["axes.nodes", "empty name"]),
            ("[axes]\nnodes = [\"a\"]\nmodule_src = [\"\"]\n", &["axes.module_src", "empty path"]),
            ("[axes]\nnodes = [\"a\"]\n[run]\ncpus = 0\n", &["run.cpus", "at least 1"]),
            ("[axes]\nnodes = [\"a\"]\n[run]\ntimeout = 0\n", &["run.timeout", "at least 1"]),
            ("name = \" \"\n[axes]\nnodes = [\"a\"]\n", &["/m/x.toml", "name", "empty"]),
        ] {
            let e = err(text);
            for word in words {
                assert!(e.contains(word), "{text:?}: {e:?} lacks {word:?}");
            }
        }
        let e = format!("{:#}", Matrix::load(Path::new("/nonexistent/m.toml")).unwrap_err());
        assert!(e.contains("/nonexistent/m.toml") && e.contains("cannot be read"), "{e}");
    }

    #[test]
    fn test_cells_are_the_product_in_stable_order() {
        let m = parse(
            r#"[axes]
            kernels = ["debian:6.1.0-47", "debian:6.12.117+deb12"]
            nodes = ["minimal", "vela-a100"]
            append = ["", "pci=noats"]
            module_src = ["a/drv", "b/nic"]
            suites = ["smoke", "smoke,topology"]
            "#,
        )
        .unwrap();
        let cells = m.cells();
        assert_eq!(cells.len(), 32);
        assert!(cells.iter().enumerate().all(|(i, c)| c.index == i));
        // Suites vary fastest, kernels slowest.
        assert_eq!(cells[0].name(), "6.1.0-47/minimal/smoke+drv");
        assert_eq!(cells[1].name(), "6.1.0-47/minimal/smoke,topology+drv");
        assert_eq!(cells[2].name(), "6.1.0-47/minimal/smoke+nic");
        assert_eq!(cells[4].name(), "6.1.0-47/minimal/smoke+pci=noats+drv");
        assert_eq!(cells[8].name(), "6.1.0-47/vela-a100/smoke+drv");
        assert_eq!(cells[16].name(), "6.12.117+deb12/minimal/smoke+drv");
        let c = &cells[31];
        assert_eq!(c.kernel, "debian:6.12.117+deb12");
        assert_eq!(c.node, "vela-a100");
        assert_eq!(c.append, "pci=noats");
        assert_eq!(c.module_src, Some(PathBuf::from("/m/b/nic")));
        assert_eq!(c.suites, ["smoke", "topology"]);
        assert_eq!(m.cells(), cells, "stable");
        let names: HashSet<&str> = cells.iter().map(Cell::name).collect();
        assert_eq!(names.len(), cells.len());
        // One value on an axis: not in the name.
        let one = parse("[axes]\nkernels = [\"debian:6.1.0-47\"]\nnodes = [\"vela-a100\"]\nappend = [\"pci=noats\"]\nmodule_src = [\"drv\"]\n").unwrap();
        assert_eq!(one.cells()[0].name(), "6.1.0-47/vela-a100/smoke");
        assert_eq!(one.cells()[0].file_stem(), "001-6.1.0-47_vela-a100_smoke");
    }

    #[test]
    fn test_include_adds_cells_after_the_product() {
        let m = parse(
            "[axes]\nkernels = [\"debian:6.1.0-57\", \"debian:6.12.117+deb12\"]\nnodes = [\"minimal\", \"vela-a100\"]\n\
             [[include]]\nnode = \"vela-a100\"\nappend = \"numa=off\"\nsuites = \"smoke,topology\"\n",
        )
        .unwrap();
        let cells = m.cells();
        assert_eq!(cells.len(), 5);
        let extra = &cells[4];
        assert_eq!((extra.index, extra.kernel.as_str(), extra.append.as_str()), (4, "default", "numa=off"));
        assert_eq!(extra.suites, ["smoke", "topology"]);
        assert_eq!(extra.name(), "default/vela-a100/smoke,topology+numa=off");
        let e = format!("{:#}", parse("[axes]\nnodes = [\"minimal\"]\n[[include]]\nnode = \"\"\n").unwrap_err());
        assert!(e.contains("include[0]"), "{e}");
    }

    #[test]
    fn test_cell_names_and_file_stems_stay_unique() {
        // Short labels alike (two bzImage, two n.toml): the axis uses full values.
        let m = parse("[axes]\nkernels = [\"/k/x/bzImage\", \"/k/y/bzImage\"]\nnodes = [\"n.toml\", \"/q/n.toml\"]\n")
            .unwrap();
        let cells = m.cells();
        let names: Vec<&str> = cells.iter().map(Cell::name).collect();
        assert_eq!(
            names,
            [
                "/k/x/bzImage//m/n.toml/smoke",
                "/k/x/bzImage//q/n.toml/smoke",
                "/k/y/bzImage//m/n.toml/smoke",
                "/k/y/bzImage//q/n.toml/smoke"
            ]
        );
        // Values can still make two names alike (a suite named like an append variant):
        // those get their 1-based index.
        let m = parse("[axes]\nnodes = [\"a\"]\nappend = [\"\", \"x\"]\nsuites = [\"smoke\", \"smoke+x\"]\n").unwrap();
        let cells = m.cells();
        let names: Vec<&str> = cells.iter().map(Cell::name).collect();
        assert_eq!(names, ["default/a/smoke", "default/a/smoke+x#2", "default/a/smoke+x#3", "default/a/smoke+x+x"]);
        let stems: HashSet<String> = cells.iter().map(Cell::file_stem).collect();
        assert_eq!(stems.len(), cells.len());
        for stem in &stems {
            assert!(stem.chars().all(|c| c.is_ascii_alphanumeric() || "._+=,-".contains(c)), "{stem}");
        }
    }

    #[test]
    fn test_shard_parse_and_partition() {
        assert_eq!("2/3".parse::<Shard>().unwrap(), Shard { index: 2, count: 3 });
        for (bad, words) in [
            ("0/2", "from 1 to N"),
            ("3/2", "from 1 to N"),
            ("1/0", "at least 1"),
            ("x/2", "not a whole number"),
            ("1/2/3", "not a whole number"),
            ("2", "expected I/N"),
            ("", "expected I/N"),
        ] {
            let e = format!("{:#}", bad.parse::<Shard>().unwrap_err());
            assert!(e.contains(words) && e.contains(&format!("'{bad}'")), "{bad}: {e}");
        }
        let m = parse("[axes]\nkernels = [\"debian:1\", \"debian:2\", \"debian:3\"]\nnodes = [\"a\", \"b\", \"c\"]\n")
            .unwrap();
        let cells = m.cells();
        let second: Vec<usize> = Shard { index: 2, count: 4 }.select(cells.clone()).iter().map(|c| c.index).collect();
        assert_eq!(second, [1, 5]);
        for n in 1..=10 {
            let mut all: Vec<usize> =
                (1..=n).flat_map(|i| Shard { index: i, count: n }.select(cells.clone())).map(|c| c.index).collect();
            all.sort_unstable();
            assert_eq!(all, (0..cells.len()).collect::<Vec<_>>(), "{n} shards");
        }
    }

    const PASSING: &str = "KTAP version 1\n1..1\n    KTAP version 1\n    # Subtest: smoke\n    1..3\n    # release 6.1.0-47-amd64\n    ok 1 kernel_release\n    ok 2 online_cpus\n    ok 3 memory # SKIP no VMM expectations\nok 1 smoke\n";
    const FAILING: &str = "KTAP version 1\n1..1\n    KTAP version 1\n    # Subtest: smoke\n    1..3\n    ok 1 kernel_release\n    # online_cpus: 1 online, <2> & \"configured\"\n    not ok 2 online_cpus\n    ok 3 memory # SKIP no VMM expectations\nnot ok 1 smoke\n";

    fn report(exit_code: i32, console: &str, problem: Option<&str>, millis: u64) -> CellReport {
        CellReport {
            exit_code,
            ktap: ktap::parse(console),
            problem: problem.map(str::to_owned),
            elapsed: Duration::from_millis(millis),
            console_tail: if problem.is_some() { vec!["[ 1.0] a <tail> line".into()] } else { Vec::new() },
        }
    }

    /// Two kernels (one 6.1, one 6.12) × two presets; the cell `broken` fails.
    fn two_by_two(broken: usize) -> Vec<(Cell, CellReport)> {
        let m = parse(
            "[axes]\nkernels = [\"debian:6.1.0-47\", \"debian:6.12.117+deb12\"]\nnodes = [\"minimal\", \"vela-a100\"]\n",
        )
        .unwrap();
        m.cells()
            .into_iter()
            .map(|c| {
                let r =
                    if c.index == broken { report(1, FAILING, None, 2_500) } else { report(0, PASSING, None, 1_250) };
                (c, r)
            })
            .collect()
    }

    /// Element → (allowed attributes, allowed children in the schema's order), from
    /// jenkins-junit.xsd; `None`: text only.
    fn schema(tag: &str) -> Option<(&'static [&'static str], &'static [&'static str])> {
        Some(match tag {
            "testsuites" => (&["name", "time", "tests", "failures", "disabled", "errors"], &["testsuite"]),
            "testsuite" => (
                &[
                    "name",
                    "tests",
                    "failures",
                    "errors",
                    "time",
                    "disabled",
                    "skipped",
                    "timestamp",
                    "hostname",
                    "id",
                    "package",
                ],
                &["properties", "testcase", "system-out", "system-err"],
            ),
            "properties" => (&[], &["property"]),
            "property" => (&["name", "value"], &[]),
            "testcase" => (
                &["name", "assertions", "time", "classname", "status"],
                &["skipped", "error", "failure", "system-out", "system-err"],
            ),
            "failure" | "error" => (&["type", "message"], &[]),
            "skipped" | "system-out" | "system-err" => (&[], &[]),
            _ => return None,
        })
    }

    /// Checks `xml` against jenkins-junit.xsd's elements, attributes, required attributes
    /// and child order; returns the parsed document.
    fn check_junit(xml: &str) -> roxmltree::Document<'_> {
        let doc = roxmltree::Document::parse(xml).expect("well-formed XML");
        assert_eq!(doc.root_element().tag_name().name(), "testsuites");
        for node in doc.descendants().filter(roxmltree::Node::is_element) {
            let tag = node.tag_name().name();
            let (attrs, children) = schema(tag).unwrap_or_else(|| panic!("<{tag}> is not in the schema"));
            for a in node.attributes() {
                assert!(attrs.contains(&a.name()), "<{tag}> may not have {}", a.name());
            }
            for required in match tag {
                "testsuite" => &["name", "tests"][..],
                "testcase" => &["name"],
                "property" => &["name", "value"],
                _ => &[],
            } {
                assert!(node.attribute(*required).is_some(), "<{tag}> lacks {required}");
            }
            let mut last = 0;
            for child in node.children() {
                if child.is_element() {
                    let at = children.iter().position(|c| *c == child.tag_name().name());
                    let at = at.unwrap_or_else(|| panic!("<{}> may not be in <{tag}>", child.tag_name().name()));
                    assert!(at >= last, "<{}> out of order in <{tag}>", child.tag_name().name());
                    last = at;
                } else if child.is_text() && !children.is_empty() {
                    assert!(child.text().unwrap_or("").trim().is_empty(), "text in <{tag}>");
                }
            }
            if tag == "properties" {
                assert!(node.children().any(|c| c.is_element()), "empty <properties>");
            }
            if tag == "testcase" {
                assert!(node.children().filter(|c| c.has_tag_name("skipped")).count() <= 1);
            }
        }
        doc
    }

    fn attr<'a>(node: roxmltree::Node<'a, '_>, name: &str) -> &'a str {
        node.attribute(name).unwrap_or_else(|| panic!("no {name}"))
    }

    #[test]
    fn test_broken_cell_fails_alone() {
        let results = two_by_two(2);
        let broken = results[2].0.name().to_owned();
        assert_eq!(broken, "6.12.117+deb12/minimal/smoke");
        assert_eq!(matrix_exit(&results), exit::FAIL);

        let xml = junit_cells("pair", &results);
        let doc = check_junit(&xml);
        let root = doc.root_element();
        assert_eq!(
            [attr(root, "name"), attr(root, "tests"), attr(root, "failures"), attr(root, "errors"), attr(root, "time")],
            ["pair", "12", "1", "0", "6.250"]
        );
        let suites: Vec<_> = root.children().filter(|n| n.has_tag_name("testsuite")).collect();
        assert_eq!(suites.len(), 4);
        for (suite, (cell, _)) in suites.iter().zip(&results) {
            assert_eq!(attr(*suite, "name"), cell.name());
            let failing = if cell.index == 2 { "1" } else { "0" };
            assert_eq!(
                [attr(*suite, "tests"), attr(*suite, "failures"), attr(*suite, "errors"), attr(*suite, "skipped")],
                ["3", failing, "0", "1"]
            );
            let cases: Vec<_> = suite.children().filter(|n| n.has_tag_name("testcase")).collect();
            assert_eq!(cases.len(), 3);
            assert_eq!(attr(cases[1], "classname"), format!("{}.smoke", cell.name()));
            assert_eq!(attr(cases[1], "name"), "online_cpus");
            let failure = cases[1].children().find(|n| n.has_tag_name("failure"));
            assert_eq!(failure.is_some(), cell.index == 2);
            if let Some(failure) = failure {
                assert_eq!(attr(failure, "message"), "online_cpus: 1 online, <2> & \"configured\"");
            }
            let skipped = cases[2].children().find(|n| n.has_tag_name("skipped")).expect("skipped");
            assert_eq!(skipped.text(), Some("no VMM expectations"));
            let kernel = suite.descendants().find(|n| n.attribute("name") == Some("kernel")).expect("property");
            assert_eq!(attr(kernel, "value"), cell.kernel);
        }

        let table = summary_table(&results);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 6, "{table}");
        assert!(lines[0].starts_with("cell") && lines[0].contains("verdict"), "{table}");
        for (line, (cell, _)) in lines[1..5].iter().zip(&results) {
            let words: Vec<&str> = line.split_whitespace().collect();
            let expect = if cell.index == 2 { ["FAIL", "1", "1", "1"] } else { ["PASS", "2", "0", "1"] };
            assert_eq!(words[..5], [cell.name(), expect[0], expect[1], expect[2], expect[3]], "{table}");
        }
        // Columns line up.
        let at = lines[0].find("verdict").expect("verdict");
        assert!(lines[1..5].iter().all(|l| l[at..].starts_with("PASS") || l[at..].starts_with("FAIL")), "{table}");
        assert_eq!(
            lines[5],
            "total: 4 cells: 3 PASS, 1 FAIL, 0 CANNOT TEST; checks: 7 passed, 1 failed, 4 skipped; 6.2s"
        );

        let diff = differences(&results);
        assert_eq!(
            diff,
            format!(
                "smoke.online_cpus  ok on 6.1.0-47/minimal/smoke, 6.1.0-47/vela-a100/smoke, \
                 6.12.117+deb12/vela-a100/smoke; FAIL on {broken}\n"
            )
        );
        assert_eq!(differences(&two_by_two(99)), "");
        assert_eq!(matrix_exit(&two_by_two(99)), exit::PASS);
        assert_eq!(matrix_exit(&[]), exit::PASS);
    }

    #[test]
    fn test_cell_that_cannot_test_reports_boot_error() {
        let mut results = two_by_two(99);
        results[1].1 = report(125, "", Some("no package linux-image-6.1.0-47-amd64 in the archive"), 300);
        results[3].1 = report(1, "KTAP version 1\n1..1\n", Some("the guest kernel panicked"), 4_000);
        let xml = junit_cells("m", &results);
        let doc = check_junit(&xml);
        let root = doc.root_element();
        assert_eq!([attr(root, "tests"), attr(root, "failures"), attr(root, "errors")], ["8", "0", "2"]);
        let suite = root.children().filter(|n| n.has_tag_name("testsuite")).nth(1).expect("suite");
        assert_eq!([attr(suite, "tests"), attr(suite, "errors")], ["1", "1"]);
        let case = suite.children().find(|n| n.has_tag_name("testcase")).expect("testcase");
        assert_eq!([attr(case, "name"), attr(case, "classname")], ["boot", results[1].0.name()]);
        let error = case.children().find(|n| n.has_tag_name("error")).expect("error");
        assert_eq!(attr(error, "message"), "no package linux-image-6.1.0-47-amd64 in the archive");
        let text = error.text().expect("text");
        assert!(text.contains("last 1 console lines:\n[ 1.0] a <tail> line"), "{text}");
        assert_eq!(matrix_exit(&results), exit::FAIL);
        results[3].1 = report(0, PASSING, None, 1_000);
        assert_eq!(matrix_exit(&results), exit::CANNOT_TEST);
        let table = summary_table(&results);
        assert!(table.lines().nth(2).expect("row").contains("CANNOT TEST"), "{table}");
        assert!(table.contains("3 PASS, 0 FAIL, 1 CANNOT TEST"), "{table}");

        // Failed with no failing check and no problem: still an error to see.
        let quiet = report(1, PASSING, None, 1);
        assert_eq!(quiet.boot_error().as_deref(), Some("failed (exit 1) without a failing KTAP check"));
        assert_eq!(report(2, "", None, 1).verdict(), Verdict::CannotTest);
        assert_eq!(report(2, "", None, 1).boot_error().as_deref(), Some("could not test (exit 2)"));
    }

    #[test]
    fn test_differences_list_outcome_per_cell() {
        let topology = |ats: &str, acs: &str| {
            format!("KTAP version 1\n1..1\n    1..2\n    {ats} 1 ats\n    ok 2 acs_enabled{acs}\nok 1 topology\n")
        };
        let mut results = two_by_two(99);
        results[0].1 = report(0, &topology("ok", ""), None, 1);
        results[1].1 = report(1, &topology("not ok", ""), None, 1);
        results[2].1 = report(0, &topology("ok", " # SKIP no ACS"), None, 1);
        results[3].1 = report(125, "", Some("no package"), 1);
        let diff = differences(&results);
        let names: Vec<&str> = results.iter().map(|(c, _)| c.name()).collect();
        assert_eq!(
            diff,
            format!(
                "topology.ats          ok on {0}, {2}; FAIL on {1}\ntopology.acs_enabled  ok on {0}, {1}; skip on {2}\n",
                names[0], names[1], names[2]
            )
        );
    }

    #[test]
    fn test_merge_of_shards_equals_whole() {
        let results = two_by_two(1);
        let whole = junit_cells("kernels", &results);
        let dir = tempfile::tempdir().unwrap();
        let mut files = Vec::new();
        for i in 1..=2 {
            let shard = Shard { index: i, count: 2 };
            let cells = shard.select(results.iter().map(|(c, _)| c.clone()).collect());
            let part: Vec<_> = results.iter().filter(|(c, _)| cells.contains(c)).cloned().collect();
            assert_eq!(part.len(), 2);
            let path = dir.path().join(format!("shard-{i}.xml"));
            std::fs::write(&path, junit_cells("kernels", &part)).unwrap();
            files.push(path);
        }
        let merged = merge(&files).unwrap();
        let (a, b) = (check_junit(&whole), check_junit(&merged));
        for key in ["name", "tests", "failures", "errors", "time"] {
            assert_eq!(attr(a.root_element(), key), attr(b.root_element(), key), "{key}");
        }
        let suites = |d: &roxmltree::Document| {
            let mut v: Vec<String> = d
                .root_element()
                .children()
                .filter(|n| n.has_tag_name("testsuite"))
                .map(|n| attr(n, "name").to_owned())
                .collect();
            v.sort();
            v
        };
        assert_eq!(suites(&a), suites(&b));
        assert_eq!(attr(b.root_element(), "failures"), "1");

        // Foreign JUnit: the harness's single-run document and a bare <testsuite>.
        let single = dir.path().join("boot.xml");
        let ktap = ktap::parse(FAILING);
        std::fs::write(&single, gdrvm_harness::junit::render("boot", &ktap, Some("guest panicked"))).unwrap();
        let bare = dir.path().join("bare.xml");
        std::fs::write(
            &bare,
            "<?xml version=\"1.0\"?>\n<testsuite name=\"t\" tests=\"2\" time=\"0.5\"><testcase name=\"a\"/><testcase name=\"b\"><skipped/></testcase></testsuite>\n",
        )
        .unwrap();
        let merged = merge(&[files[0].clone(), single, bare.clone()]).unwrap();
        let doc = roxmltree::Document::parse(&merged).unwrap();
        let root = doc.root_element();
        // Shard 1: 6 tests, 0 failures; boot.xml: smoke (3, 1 failure) + run (1 error); bare: 2.
        assert_eq!(
            [attr(root, "name"), attr(root, "tests"), attr(root, "failures"), attr(root, "errors"), attr(root, "time")],
            ["merged", "12", "1", "1", "3.000"]
        );
        assert_eq!(root.children().filter(|n| n.has_tag_name("testsuite")).count(), 5);

        let junk = dir.path().join("junk.xml");
        std::fs::write(&junk, "<html><body/></html>").unwrap();
        let e = format!("{:#}", merge(std::slice::from_ref(&junk)).unwrap_err());
        assert!(e.contains("junk.xml") && e.contains("<html>"), "{e}");
        std::fs::write(&junk, "<testsuites><testsuite").unwrap();
        let e = format!("{:#}", merge(std::slice::from_ref(&junk)).unwrap_err());
        assert!(e.contains("junk.xml") && e.contains("not well-formed"), "{e}");
        std::fs::write(&junk, "<testsuite name=\"s\" tests=\"0\" time=\"soon\"/>").unwrap();
        let e = format!("{:#}", merge(&[junk]).unwrap_err());
        assert!(e.contains("junk.xml") && e.contains("'soon' is not a number"), "{e}");
        assert!(merge(&[dir.path().join("missing.xml")]).is_err());
        assert!(merge(&[]).is_err());
    }

    #[test]
    fn test_cell_report_from_vm_result() {
        let console: Vec<String> = FAILING.lines().map(str::to_owned).collect();
        let result = VmResult::new("cell", VmOutcome::Exited(1), console.clone(), Duration::from_secs(3));
        let report = CellReport::from(&result);
        assert_eq!(report.exit_code, exit::FAIL);
        assert_eq!(report.verdict(), Verdict::Fail);
        assert_eq!(report.problem, None);
        assert_eq!(report.ktap.counts(), (1, 1, 1));
        assert_eq!(report.console_tail, console);
        assert_eq!(report.elapsed, Duration::from_secs(3));
    }

    #[test]
    fn test_shipped_kernels_matrix_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../matrix/kernels.toml");
        let m = Matrix::load(&path).unwrap();
        assert_eq!(m.name, "kernels");
        assert_eq!(m.nodes, ["vela-a100"]);
        assert!(m.kernels.iter().all(|k| k.starts_with("debian:6.1.0-") || k.starts_with("debian:6.12.")));
        assert!(m.kernels.len() >= 2);
        let cells = m.cells();
        assert_eq!(cells.len(), m.kernels.len() * 2);
        assert_eq!(cells[0].name(), format!("{}/vela-a100/smoke", kernel_label(&m.kernels[0])));
        assert_eq!(cells[1].suites, ["topology"]);
    }
}
