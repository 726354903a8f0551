//! Bisection for `cargo xtask bisect`: the first bad candidate in an ordered list (kernels
//! from the lock file in version order, a matrix axis, a user's list), found by binary search
//! with a majority vote per step for flaky tests, and candidates that cannot be tested (exit
//! 125: no package, a module that does not build, a guest that never reaches the agent)
//! stepped around as `git bisect skip` does.
//!
//! # How many boots
//! The ends are trusted by default: `--good` is good and `--bad` is bad without a boot. The
//! first bad candidate is then one of the `d = bad - good` candidates after the good end, and
//! each step halves them (rounding up), so a bisection with nothing skipped takes at most
//! `ceil(log2(d))` steps: [`max_steps`]`(n) = ceil(log2(n - 1))` for `n` candidates from the good
//! end to the bad end, which is at most `ceil(log2(n))`. A step is one vote of up to `--repeat`
//! boots. `verify_ends` adds two steps (one per end) before the search. Each skipped candidate
//! costs one step more, and a neighbour of the middle then splits the range unevenly.

use std::cmp::Ordering;
use std::fmt;

use anyhow::{bail, ensure, Result};
use gdrvm_harness::exit;

/// What testing a candidate said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The test passed: the regression came later.
    Good,
    /// The test failed: the regression is here or earlier.
    Bad,
    /// The candidate could not be tested (exit 125), with the reason.
    Skip(String),
}

impl Verdict {
    /// The verdict of an exit status by `git bisect run`'s protocol, which is also
    /// `cargo xtask boot`'s: 0 good, 125 cannot test (`why` says why), anything else bad.
    pub fn from_exit(code: i32, why: &str) -> Verdict {
        match code {
            exit::PASS => Verdict::Good,
            exit::CANNOT_TEST => Verdict::Skip(why.to_string()),
            _ => Verdict::Bad,
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Good => f.write_str("good"),
            Verdict::Bad => f.write_str("bad"),
            Verdict::Skip(why) => write!(f, "skip: {why}"),
        }
    }
}

/// Tests one candidate: the real one boots a guest with that kernel or driver and runs the
/// selected suite or KTAP test; unit tests use fakes. Async, so that boots run on the
/// caller's runtime and Ctrl-C (which drops the bisection's future) stops them.
pub trait Probe {
    /// Tests `candidate` once. `attempt` counts this candidate's tests from 0 (a vote of
    /// three asks for attempts 0, 1 and 2, fewer once the majority is certain).
    async fn test(&mut self, candidate: &str, attempt: usize) -> Verdict;
}

/// How many times each candidate is tested: the majority of up to `repeats` tests decides,
/// which outvotes a flaky test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vote {
    repeats: usize,
}

/// One vote's result: the verdict and every attempt that led to it, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ballot {
    /// Good or Bad by majority; Skip when there is none.
    pub verdict: Verdict,
    /// Each test's verdict.
    pub attempts: Vec<Verdict>,
}

impl Vote {
    /// A vote of up to `repeats` tests per candidate; `repeats` must be odd (1, 3, 5...) so
    /// that a test that answers every time cannot tie.
    pub fn new(repeats: usize) -> Result<Vote> {
        ensure!(repeats % 2 == 1, "--repeat must be odd (1, 3, 5...) so that votes cannot tie, not {repeats}");
        Ok(Vote { repeats })
    }

    /// Tests `candidate` up to `repeats` times and takes the majority of the Good and Bad
    /// answers. Skips are not votes: Skip, Good, Skip is Good. It stops as soon as the
    /// remaining attempts can no longer change the majority (Good, Good of three). With no
    /// majority at the end (as many Good as Bad, or every attempt skipped), the candidate is
    /// Skip, with the reasons.
    pub async fn decide(&self, probe: &mut impl Probe, candidate: &str) -> Ballot {
        let mut attempts = Vec::with_capacity(self.repeats);
        let (mut good, mut bad) = (0usize, 0usize);
        for attempt in 0..self.repeats {
            let verdict = probe.test(candidate, attempt).await;
            match verdict {
                Verdict::Good => good += 1,
                Verdict::Bad => bad += 1,
                Verdict::Skip(_) => {}
            }
            attempts.push(verdict);
            if good.abs_diff(bad) > self.repeats - attempt - 1 {
                break;
            }
        }
        let verdict = match good.cmp(&bad) {
            Ordering::Greater => Verdict::Good,
            Ordering::Less => Verdict::Bad,
            Ordering::Equal => Verdict::Skip(no_majority(&attempts, good)),
        };
        Ballot { verdict, attempts }
    }
}

/// Why a vote found no majority: the skips' distinct reasons, and the tie if there was one.
fn no_majority(attempts: &[Verdict], each: usize) -> String {
    let mut reasons: Vec<&str> = Vec::new();
    for a in attempts {
        if let Verdict::Skip(why) = a {
            if !reasons.contains(&why.as_str()) {
                reasons.push(why);
            }
        }
    }
    let reasons = reasons.join("; ");
    match (each, attempts.len()) {
        (0, 1) => reasons,
        (0, n) => format!("all {n} attempts could not test: {reasons}"),
        (_, n) if reasons.is_empty() => format!("no majority: {each} good and {each} bad of {n}"),
        (_, n) => format!("no majority: {each} good and {each} bad of {n}; the others could not test: {reasons}"),
    }
}

/// What a bisection is asked: where its ends are and how each candidate is judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BisectPlan {
    /// Index of the known good candidate (`--good`); it must come before `bad`.
    pub good: usize,
    /// Index of the known bad candidate (`--bad`).
    pub bad: usize,
    /// Tests per candidate.
    pub vote: Vote,
    /// Test the ends first (two more steps) instead of trusting them.
    pub verify_ends: bool,
}

/// One step of a bisection, reported as it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Steps so far, this one included (from 1).
    pub number: usize,
    /// The candidate tested.
    pub candidate: String,
    /// Its index in the candidate list.
    pub index: usize,
    /// The vote's verdict.
    pub verdict: Verdict,
    /// Every attempt of the vote.
    pub attempts: Vec<Verdict>,
    /// Candidates that may still be the first bad one after this step (skipped ones
    /// included); 1 once the first bad one is known.
    pub remaining: usize,
    /// This step's number plus the steps still needed at most if nothing more is skipped
    /// (`ceil(log2(remaining))`, an estimate once candidates were skipped).
    pub at_most: usize,
}

impl fmt::Display for Step {
    /// `step 3 of at most 4: debian:6.1.0-52 -> bad (2 of 3 bad)`; the count is left out
    /// when the vote took one attempt.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {} of at most {}: {} -> {}", self.number, self.at_most, self.candidate, self.verdict)?;
        let n = self.attempts.len();
        if n > 1 && !matches!(self.verdict, Verdict::Skip(_)) {
            let agreeing = self.attempts.iter().filter(|a| **a == self.verdict).count();
            write!(f, " ({agreeing} of {n} {})", self.verdict)?;
        }
        Ok(())
    }
}

/// How a bisection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BisectOutcome {
    /// The first bad candidate: the one before it is good.
    FirstBad {
        /// Its index in the candidate list.
        index: usize,
        /// Its name.
        candidate: String,
    },
    /// Candidates that could not be tested hide the answer: the first bad is one of
    /// `from..=to`, where every one but `to` was skipped and `to` is bad.
    Range {
        /// Index of the first that may be the first bad.
        from: usize,
        /// Index of the last, a bad one.
        to: usize,
        /// Their names, `from` to `to`.
        names: Vec<String>,
    },
    /// `verify_ends` found an end that is not what it was said to be, or could not test it.
    EndsWrong(String),
}

impl fmt::Display for BisectOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BisectOutcome::FirstBad { candidate, .. } => write!(f, "first bad: {candidate}"),
            BisectOutcome::Range { names, .. } => {
                let (last, skipped) = names.split_last().map_or(("", &[][..]), |(l, s)| (l.as_str(), s));
                let first = names.first().map_or("", String::as_str);
                write!(f, "first bad is one of {first}..{last} (skipped: {})", skipped.join(", "))
            }
            BisectOutcome::EndsWrong(why) => f.write_str(why),
        }
    }
}

/// A finished bisection: how it ended and every step that led there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bisection {
    /// The answer.
    pub outcome: BisectOutcome,
    /// The steps, in order (the same ones `log` saw).
    pub steps: Vec<Step>,
}

/// Steps a binary search needs at most to find the first bad one among `span` candidates
/// that may be it: `ceil(log2(span))`.
fn steps_for(span: usize) -> usize {
    match span {
        0 | 1 => 0,
        _ => (span - 1).ilog2() as usize + 1,
    }
}

/// Steps a bisection of `n` candidates, good end first and bad end last, takes at most when
/// the ends are trusted and nothing is skipped: `ceil(log2(n - 1))` (0 for `n <= 2`), which
/// is at most `ceil(log2(n))`. Each step is one vote of up to `--repeat` boots.
pub fn max_steps(n: usize) -> usize {
    steps_for(n.saturating_sub(1))
}

/// Finds the first bad candidate between `plan.good` and `plan.bad` (indices into
/// `candidates`, ordered oldest to newest), calling `log` as each step ends. A candidate the
/// vote calls Skip is not tried again; its neighbour closest to the middle of the range is
/// tried instead (alternating sides), and if every candidate in the range is skipped the
/// outcome is the range. Errors are usage errors (ends out of order or out of the list).
pub async fn bisect(
    candidates: &[String],
    plan: &BisectPlan,
    probe: &mut impl Probe,
    log: &mut impl FnMut(&Step),
) -> Result<Bisection> {
    let (good, bad) = (plan.good, plan.bad);
    for (flag, index) in [("--good", good), ("--bad", bad)] {
        ensure!(index < candidates.len(), "{flag} is candidate {} of only {}", index + 1, candidates.len());
    }
    ensure!(
        good < bad,
        "--good ({}) must come before --bad ({}) in the candidate order (oldest first): bisect finds the first \
         bad candidate after a good one",
        candidates[good],
        candidates[bad]
    );
    let mut steps = Vec::new();
    // Logs and keeps a step; `remaining` is the range left after it, `pending` the end checks
    // still to come.
    let mut record = |index: usize, ballot: Ballot, remaining: usize, pending: usize| {
        let number = steps.len() + 1;
        let step = Step {
            number,
            candidate: candidates[index].clone(),
            index,
            verdict: ballot.verdict.clone(),
            attempts: ballot.attempts,
            remaining,
            at_most: number + pending + steps_for(remaining),
        };
        log(&step);
        steps.push(step);
        ballot.verdict
    };
    if plan.verify_ends {
        for (index, said, pending) in [(good, Verdict::Good, 1), (bad, Verdict::Bad, 0)] {
            let ballot = plan.vote.decide(probe, &candidates[index]).await;
            let wrong = match record(index, ballot, bad - good, pending) {
                v if v == said => continue,
                Verdict::Skip(why) => format!("the {said} end {} could not be tested: {why}", candidates[index]),
                v => format!("the {said} end {} tested {v}: nothing to bisect between the ends", candidates[index]),
            };
            return Ok(Bisection { outcome: BisectOutcome::EndsWrong(wrong), steps });
        }
    }
    // The first bad candidate is in lo+1..=hi: lo is good (or the good end), hi bad.
    let (mut lo, mut hi) = (good, bad);
    let mut skipped = vec![false; candidates.len()];
    while let Some(index) = next_candidate(lo, hi, &skipped) {
        let ballot = plan.vote.decide(probe, &candidates[index]).await;
        match ballot.verdict {
            Verdict::Good => lo = index,
            Verdict::Bad => hi = index,
            Verdict::Skip(_) => skipped[index] = true,
        }
        record(index, ballot, hi - lo, 0);
    }
    let outcome = if hi - lo == 1 {
        BisectOutcome::FirstBad { index: hi, candidate: candidates[hi].clone() }
    } else {
        BisectOutcome::Range { from: lo + 1, to: hi, names: candidates[lo + 1..=hi].to_vec() }
    };
    Ok(Bisection { outcome, steps })
}

/// The candidate to test next strictly between `lo` (good) and `hi` (bad): the middle, or
/// the closest one to it not yet skipped, upper side first; None when none is left.
fn next_candidate(lo: usize, hi: usize, skipped: &[bool]) -> Option<usize> {
    let mid = lo + (hi - lo) / 2;
    (0..hi - lo)
        .flat_map(|d| [mid.checked_add(d), if d == 0 { None } else { mid.checked_sub(d) }])
        .flatten()
        .find(|&i| i > lo && i < hi && !skipped[i])
}

/// The lock file's kernels as bisection candidates: in version order
/// ([`gdrvm_images::kernel_order`]),
/// oldest first, each once.
pub fn candidates_from_lock(mut kernels: Vec<String>) -> Vec<String> {
    kernels.sort_by(|a, b| gdrvm_images::kernel_order(a, b));
    kernels.dedup();
    kernels
}

/// The index of the candidate `name` names (`--good`, `--bad`): the one spelled exactly so,
/// else the only one that starts with it (also after its `debian:`-style prefix, so
/// `6.12.117` finds `debian:6.12.117+deb12`) or ends with it (`6.1.0-47`).
pub fn find(candidates: &[String], name: &str) -> Result<usize> {
    if let Some(i) = candidates.iter().position(|c| c == name) {
        return Ok(i);
    }
    let matches: Vec<usize> = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| {
            let bare = c.split_once(':').map_or(c.as_str(), |(_, rest)| rest);
            !name.is_empty() && (c.starts_with(name) || bare.starts_with(name) || c.ends_with(name))
        })
        .map(|(i, _)| i)
        .collect();
    match matches[..] {
        [i] => Ok(i),
        [] => bail!("no candidate is named `{name}`; the candidates are: {}", candidates.join(", ")),
        _ => {
            let names: Vec<&str> = matches.iter().map(|&i| candidates[i].as_str()).collect();
            bail!("`{name}` could be any of {}: give more of the name", names.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Candidates `c0`, `c1`, ... `c{n-1}`.
    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("c{i}")).collect()
    }

    fn index_of(candidate: &str) -> usize {
        candidate[1..].parse().expect("test candidates are c<number>")
    }

    /// The regression lands at `first_bad`; candidates in `broken` cannot be tested; with
    /// `flaky`, every candidate answers wrong once in three attempts (attempt 0, 1 or 2,
    /// depending on the candidate). Counts its calls.
    struct Planted {
        first_bad: usize,
        broken: Vec<usize>,
        flaky: bool,
        calls: usize,
    }

    impl Planted {
        fn new(first_bad: usize) -> Planted {
            Planted { first_bad, broken: Vec::new(), flaky: false, calls: 0 }
        }
    }

    impl Probe for Planted {
        async fn test(&mut self, candidate: &str, attempt: usize) -> Verdict {
            self.calls += 1;
            let i = index_of(candidate);
            if self.broken.contains(&i) {
                return Verdict::Skip(format!("{candidate} does not compile: error[E0425]"));
            }
            let bad = i >= self.first_bad;
            let bad = if self.flaky && (i + attempt) % 3 == 0 { !bad } else { bad };
            if bad {
                Verdict::Bad
            } else {
                Verdict::Good
            }
        }
    }

    /// Answers one candidate's attempts from a script.
    struct Scripted(Vec<Verdict>);

    impl Probe for Scripted {
        async fn test(&mut self, _: &str, attempt: usize) -> Verdict {
            self.0[attempt].clone()
        }
    }

    fn skip(why: &str) -> Verdict {
        Verdict::Skip(why.into())
    }

    fn plan(n: usize, repeats: usize) -> BisectPlan {
        BisectPlan { good: 0, bad: n - 1, vote: Vote::new(repeats).expect("odd"), verify_ends: false }
    }

    async fn run(candidates: &[String], plan: &BisectPlan, probe: &mut impl Probe) -> Bisection {
        let mut logged = Vec::new();
        let b = bisect(candidates, plan, probe, &mut |s: &Step| logged.push(s.clone())).await.expect("valid plan");
        assert_eq!(logged, b.steps, "log sees every step as it ends");
        b
    }

    fn ceil_log2(n: usize) -> usize {
        (0..).find(|k| 1usize << k >= n).expect("small n")
    }

    #[test]
    fn test_max_steps_is_ceil_log2_of_n_minus_1_and_within_ceil_log2_n() {
        let expected = [(1, 0), (2, 0), (3, 1), (4, 2), (5, 2), (9, 3), (10, 4), (11, 4), (17, 4), (18, 5)];
        for (n, steps) in expected {
            assert_eq!(max_steps(n), steps, "n = {n}");
        }
        for n in 2..=1000 {
            assert_eq!(max_steps(n), ceil_log2(n - 1));
            assert!(max_steps(n) <= ceil_log2(n));
        }
    }

    /// Acceptance: a planted difference found in at most ceil(log2(n)) + 1 boots. With the
    /// ends trusted and one test per step it takes at most ceil(log2(n - 1)) boots, within
    /// ceil(log2(n)): the +1 is not needed.
    #[tokio::test]
    async fn test_finds_every_planted_first_bad_within_ceil_log2_n_boots() {
        for n in 2..=20 {
            let candidates = names(n);
            for first_bad in 1..n {
                let mut probe = Planted::new(first_bad);
                let b = run(&candidates, &plan(n, 1), &mut probe).await;
                let want = BisectOutcome::FirstBad { index: first_bad, candidate: format!("c{first_bad}") };
                assert_eq!(b.outcome, want, "n = {n}");
                assert!(probe.calls <= max_steps(n), "n = {n}, first bad {first_bad}: {} boots", probe.calls);
                assert!(probe.calls <= ceil_log2(n));
                assert_eq!(b.steps.len(), probe.calls);
                let numbers: Vec<usize> = b.steps.iter().map(|s| s.number).collect();
                assert_eq!(numbers, (1..=b.steps.len()).collect::<Vec<_>>());
                assert!(b.steps.iter().all(|s| s.at_most <= max_steps(n)), "n = {n}: {:?}", b.steps);
                assert_eq!(b.steps.last().map_or(1, |s| s.remaining), 1);
            }
        }
    }

    #[tokio::test]
    async fn test_bisects_between_ends_inside_the_list() {
        let candidates = names(12);
        let mut probe = Planted::new(7);
        let p = BisectPlan { good: 3, bad: 9, ..plan(12, 1) };
        let b = run(&candidates, &p, &mut probe).await;
        assert_eq!(b.outcome, BisectOutcome::FirstBad { index: 7, candidate: "c7".into() });
        assert!(b.steps.iter().all(|s| s.index > 3 && s.index < 9));
        assert!(probe.calls <= max_steps(9 - 3 + 1));
    }

    #[tokio::test]
    async fn test_flaky_probe_is_outvoted_with_three_repeats() {
        let mut wrong_alone = 0;
        for n in 2..=20 {
            let candidates = names(n);
            for first_bad in 1..n {
                let mut probe = Planted { flaky: true, ..Planted::new(first_bad) };
                let b = run(&candidates, &plan(n, 3), &mut probe).await;
                let want = BisectOutcome::FirstBad { index: first_bad, candidate: format!("c{first_bad}") };
                assert_eq!(b.outcome, want, "n = {n}");
                assert!(probe.calls <= 3 * max_steps(n));
                for s in &b.steps {
                    let right = if s.index >= first_bad { Verdict::Bad } else { Verdict::Good };
                    assert_eq!(s.verdict, right);
                    assert!(s.attempts.len() >= 2 && s.attempts.len() <= 3);
                }
                let mut alone = Planted { flaky: true, ..Planted::new(first_bad) };
                if run(&candidates, &plan(n, 1), &mut alone).await.outcome != want {
                    wrong_alone += 1;
                }
            }
        }
        assert!(wrong_alone > 0, "without the vote the flaky probe misleads the search");
    }

    /// Every set of untestable candidates between the ends, every planted position: the
    /// answer is the first bad one when it and the one before it were testable, else the
    /// smallest range that the skips leave.
    #[tokio::test]
    async fn test_skipped_candidates_are_stepped_around_or_leave_a_range() {
        for n in 3..=9 {
            let candidates = names(n);
            for mask in 0u32..1 << (n - 2) {
                let broken: Vec<usize> = (1..n - 1).filter(|i| mask & 1 << (i - 1) != 0).collect();
                for first_bad in 1..n {
                    let mut probe = Planted { broken: broken.clone(), ..Planted::new(first_bad) };
                    let b = run(&candidates, &plan(n, 1), &mut probe).await;
                    let tested: Vec<usize> = b.steps.iter().map(|s| s.index).collect();
                    let mut once = tested.clone();
                    once.sort_unstable();
                    once.dedup();
                    assert_eq!(once.len(), tested.len(), "no candidate is tested twice: {tested:?}");
                    let hidden = broken.contains(&first_bad) || broken.contains(&(first_bad - 1));
                    match b.outcome {
                        BisectOutcome::FirstBad { index, .. } => {
                            assert!(!hidden, "n {n}, broken {broken:?}, first bad {first_bad}");
                            assert_eq!(index, first_bad);
                        }
                        BisectOutcome::Range { from, to, ref names } => {
                            assert!(hidden, "n {n}, broken {broken:?}, first bad {first_bad}");
                            assert!(from <= first_bad && first_bad <= to && from < to);
                            assert!((from..to).all(|i| broken.contains(&i)), "the range is as small as it can be");
                            assert!(!broken.contains(&to) && !broken.contains(&(from - 1)));
                            assert_eq!(names, &candidates[from..=to]);
                        }
                        BisectOutcome::EndsWrong(why) => panic!("ends are trusted: {why}"),
                    }
                }
            }
        }
    }

    #[tokio::test]
    async fn test_skipped_middle_tries_its_neighbours_alternately() {
        let candidates = names(9);
        let mut probe = Planted { broken: vec![4, 5], ..Planted::new(2) };
        let b = run(&candidates, &plan(9, 1), &mut probe).await;
        let tested: Vec<usize> = b.steps.iter().map(|s| s.index).collect();
        assert_eq!(tested, [4, 5, 3, 1, 2]);
        assert_eq!(b.steps[0].verdict, skip("c4 does not compile: error[E0425]"));
        assert_eq!(b.steps[0].remaining, 8, "a skip narrows nothing");
        assert_eq!(b.outcome, BisectOutcome::FirstBad { index: 2, candidate: "c2".into() });

        let mut hidden = Planted { broken: vec![4, 5], ..Planted::new(5) };
        let b = run(&candidates, &plan(9, 1), &mut hidden).await;
        assert_eq!(b.outcome, BisectOutcome::Range { from: 4, to: 6, names: candidates[4..=6].to_vec() });
        assert_eq!(b.outcome.to_string(), "first bad is one of c4..c6 (skipped: c4, c5)");
    }

    #[tokio::test]
    async fn test_verify_ends_tests_both_ends_and_reports_wrong_ones() {
        let candidates = names(8);
        let verified = BisectPlan { verify_ends: true, ..plan(8, 1) };
        let mut probe = Planted::new(5);
        let b = run(&candidates, &verified, &mut probe).await;
        assert_eq!(b.outcome, BisectOutcome::FirstBad { index: 5, candidate: "c5".into() });
        assert_eq!((b.steps[0].index, b.steps[1].index), (0, 7));
        assert_eq!(probe.calls, 2 + 3);
        assert_eq!(b.steps[0].at_most, 1 + 1 + max_steps(8), "the bad end's step is still to come");

        let mut probe = Planted::new(0);
        let b = run(&candidates, &verified, &mut probe).await;
        assert_eq!(
            b.outcome,
            BisectOutcome::EndsWrong("the good end c0 tested bad: nothing to bisect between the ends".into())
        );
        assert_eq!(b.steps.len(), 1);

        let mut probe = Planted::new(8);
        let b = run(&candidates, &verified, &mut probe).await;
        assert_eq!(
            b.outcome,
            BisectOutcome::EndsWrong("the bad end c7 tested good: nothing to bisect between the ends".into())
        );
        assert_eq!(b.steps.len(), 2);

        let mut probe = Planted { broken: vec![0], ..Planted::new(4) };
        let b = run(&candidates, &verified, &mut probe).await;
        let want = "the good end c0 could not be tested: c0 does not compile: error[E0425]";
        assert_eq!(b.outcome, BisectOutcome::EndsWrong(want.into()));
    }

    #[tokio::test]
    async fn test_ends_out_of_order_or_range_are_usage_errors() {
        let candidates = names(5);
        let mut probe = Planted::new(2);
        async fn error(candidates: &[String], probe: &mut Planted, good: usize, bad: usize) -> String {
            let p = BisectPlan { good, bad, ..plan(5, 1) };
            let e = bisect(candidates, &p, probe, &mut |_: &Step| {}).await;
            e.expect_err("a wrong plan").to_string()
        }
        let order = "must come before --bad (c1) in the candidate order (oldest first)";
        assert!(error(&candidates, &mut probe, 3, 1).await.starts_with(&format!("--good (c3) {order}")));
        assert!(error(&candidates, &mut probe, 1, 1).await.starts_with(&format!("--good (c1) {order}")));
        assert_eq!(error(&candidates, &mut probe, 0, 5).await, "--bad is candidate 6 of only 5");
        assert_eq!(error(&candidates, &mut probe, 9, 2).await, "--good is candidate 10 of only 5");
        assert_eq!(probe.calls, 0);
    }

    #[test]
    fn test_vote_needs_an_odd_count() {
        assert!(Vote::new(0).is_err());
        assert!(Vote::new(2).is_err());
        assert!(Vote::new(1).is_ok() && Vote::new(3).is_ok());
    }

    #[tokio::test]
    async fn test_vote_stops_when_the_majority_is_certain() {
        let vote = Vote::new(3).expect("odd");
        let ballot = vote.decide(&mut Scripted(vec![Verdict::Bad, Verdict::Bad, Verdict::Good]), "c").await;
        assert_eq!(ballot, Ballot { verdict: Verdict::Bad, attempts: vec![Verdict::Bad, Verdict::Bad] });
        let ballot = vote.decide(&mut Scripted(vec![Verdict::Good, Verdict::Bad, Verdict::Good]), "c").await;
        assert_eq!(ballot.verdict, Verdict::Good);
        assert_eq!(ballot.attempts.len(), 3);
        let five = Vote::new(5).expect("odd");
        let script = vec![Verdict::Good, Verdict::Good, Verdict::Good, Verdict::Bad, Verdict::Bad];
        assert_eq!(five.decide(&mut Scripted(script), "c").await.attempts.len(), 3);
    }

    #[tokio::test]
    async fn test_vote_skips_are_not_votes_and_no_majority_is_skip() {
        let vote = Vote::new(3).expect("odd");
        let ballot = vote.decide(&mut Scripted(vec![skip("no agent"), Verdict::Good, skip("no agent")]), "c").await;
        assert_eq!(ballot.verdict, Verdict::Good);
        assert_eq!(ballot.attempts.len(), 3);

        let ballot = vote.decide(&mut Scripted(vec![Verdict::Good, skip("oops"), Verdict::Bad]), "c").await;
        assert_eq!(ballot.verdict, skip("no majority: 1 good and 1 bad of 3; the others could not test: oops"));

        let ballot = vote.decide(&mut Scripted(vec![skip("a"), skip("b"), skip("a")]), "c").await;
        assert_eq!(ballot.verdict, skip("all 3 attempts could not test: a; b"));

        let one = Vote::new(1).expect("odd");
        let ballot = one.decide(&mut Scripted(vec![skip("no package linux-image-6.1.0-47-amd64")]), "c").await;
        assert_eq!(ballot.verdict, skip("no package linux-image-6.1.0-47-amd64"));
    }

    #[test]
    fn test_step_and_verdict_display() {
        let step = Step {
            number: 3,
            candidate: "debian:6.1.0-52".into(),
            index: 5,
            verdict: Verdict::Bad,
            attempts: vec![Verdict::Bad, Verdict::Good, Verdict::Bad],
            remaining: 2,
            at_most: 4,
        };
        assert_eq!(step.to_string(), "step 3 of at most 4: debian:6.1.0-52 -> bad (2 of 3 bad)");
        let once = Step { verdict: Verdict::Good, attempts: vec![Verdict::Good], ..step.clone() };
        assert_eq!(once.to_string(), "step 3 of at most 4: debian:6.1.0-52 -> good");
        let skipped = Step { verdict: skip("module does not build"), attempts: vec![skip("x"); 3], ..step };
        assert_eq!(skipped.to_string(), "step 3 of at most 4: debian:6.1.0-52 -> skip: module does not build");
        assert_eq!(
            BisectOutcome::FirstBad { index: 1, candidate: "debian:6.1.0-52".into() }.to_string(),
            "first bad: debian:6.1.0-52"
        );
    }

    #[test]
    fn test_verdict_from_exit_follows_git_bisect_run() {
        assert_eq!(Verdict::from_exit(0, "x"), Verdict::Good);
        assert_eq!(Verdict::from_exit(1, "x"), Verdict::Bad);
        assert_eq!(Verdict::from_exit(125, "no package"), skip("no package"));
    }

    #[test]
    fn test_find_resolves_exact_prefix_and_suffix_names() {
        let candidates = candidates_from_lock(vec![
            "debian:6.12.117+deb12".into(),
            "debian:6.1.0-47".into(),
            "debian:6.1.0-57".into(),
        ]);
        assert_eq!(find(&candidates, "debian:6.1.0-47").expect("exact"), 0);
        assert_eq!(find(&candidates, "6.1.0-57").expect("suffix"), 1);
        assert_eq!(find(&candidates, "6.12.117").expect("prefix after debian:"), 2);
        assert_eq!(find(&candidates, "debian:6.12").expect("prefix"), 2);
        let e = find(&candidates, "6.1.0").expect_err("ambiguous").to_string();
        assert_eq!(e, "`6.1.0` could be any of debian:6.1.0-47, debian:6.1.0-57: give more of the name");
        let e = find(&candidates, "6.1.0-50").expect_err("unknown").to_string();
        assert!(e.starts_with("no candidate is named `6.1.0-50`; the candidates are: debian:6.1.0-47,"), "{e}");
        assert!(find(&candidates, "").is_err());
        let exact_wins = ["a".to_string(), "ab".to_string()];
        assert_eq!(find(&exact_wins, "a").expect("exact"), 0);
    }
}
