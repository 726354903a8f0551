//! `cargo xtask bench`: figures, never assertions.
//! - `boot`: gdrvm against QEMU booting the same vmlinux and initramfs, in the same
//!   environment (inside the same L1 when nested), alternating with the order reversed
//!   every other round, medians of N runs: time and
//!   KVM's exit counts to the first KTAP line, gdrvm's setup phases and the exits it served
//!   by device; `--profile` adds one initcall-timed boot of each, side by side.
//! - `topology`: the same guest on vela-a100 and on minimal, both hollow and both as
//!   preset, the order reversed every other round, ratios paired by round: the hollow
//!   ratio is the cost of a big PCIe tree (config accesses, ACPI namespace) to the time to
//!   the agent; the preset ratio adds the emulators behind it. A ratio with a target gets
//!   its median's interval: nested, one round's ratio spreads by a third either way, so a
//!   median of a few rounds alone cannot tell 1.05 from 1.15.
//! - `ecam`: criterion's figures for one ECAM access, against a reference in the same run.
//! - `p2p`: criterion's figures for the emulated NIC's DMA into an emulated GPU's BAR
//!   against host memcpy of the same sizes, and a trapped BAR read through the emulator
//!   against an in-VMM register read; then vela-a100 with emulated GPUs and NICs against
//!   the same tree hollow, time to the agent, paired by round as `topology` is.
//! - `net`: TCP and ib_write_bw between the two nodes of `two-node`, gdrvm's wire against
//!   QEMU's `dgram` netdev, same kernel and guests, alternating, each run in an L1 of its own.

use std::time::Duration;

use anyhow::{bail, Result};
use std::collections::BTreeMap;

use gdrvm_harness::{Artifacts, ClusterSpec, GdrvmStats, QemuMachine, Runner, VmResult, VmSpec, Vmm};
use gdrvm_model::kvm_exits::{ExitReasons, KvmExits, KERNEL_MAP};

/// The VMMs compared, in the order even rounds run them ([`round_order`]).
const CONTENDERS: [(&str, Vmm); 3] = [
    ("gdrvm", Vmm::Gdrvm),
    ("qemu -M pc", Vmm::Qemu(QemuMachine::Pc)),
    ("qemu -M microvm", Vmm::Qemu(QemuMachine::Microvm)),
];

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 0 { (v[mid - 1] + v[mid]) / 2.0 } else { v[mid] })
}

/// Issue 11's targets for gdrvm over the best QEMU: time to the first KTAP line, and
/// KVM's exits until then.
const TIME_TARGET: f64 = 0.7;
const EXITS_TARGET: f64 = 0.5;

/// Fewest samples a median or ratio is printed from.
const MIN_SAMPLES: usize = 3;

/// How sure a median's interval is meant to be.
const INTERVAL_COVERAGE: f64 = 0.95;

/// A distribution-free interval for the median of the population `v` was drawn from: the
/// k-th smallest and k-th largest sample, with k as large as keeps the chance that the
/// median lies outside at most 1 - [`INTERVAL_COVERAGE`] (the number of samples below it
/// is binomial, n and 1/2); and that interval's own coverage. None with fewer than 6
/// samples, where even the smallest and largest cover less.
fn median_interval(mut v: Vec<f64>) -> Option<(f64, f64, f64)> {
    let n = v.len();
    // P(B <= j) for B ~ binomial(n, 1/2), j = 0, 1, ...
    let mut below = Vec::with_capacity(n + 1);
    let (mut choose, mut sum) = (1.0f64, 0.0f64);
    for j in 0..=n {
        if j > 0 {
            choose = choose * (n + 1 - j) as f64 / j as f64;
        }
        sum += choose;
        below.push(sum / 2f64.powi(n as i32));
    }
    let outside = |k: usize| 2.0 * below[k - 1];
    let k = (1..=n / 2).take_while(|&k| outside(k) <= 1.0 - INTERVAL_COVERAGE).last()?;
    v.sort_by(f64::total_cmp);
    Some((v[k - 1], v[n - k], 1.0 - outside(k)))
}

/// Prints "`what`: median ... over N of M runs (each run)" and returns the median, or
/// n/a when fewer than [`MIN_SAMPLES`] runs gave a figure. Figures are in seconds unless
/// `what` names its unit (`MB/s`, a ratio).
fn print_median(what: &str, times: &[f64], runs: usize) -> Option<f64> {
    let count = what.contains("exits to");
    let unit = if count || what.contains("MB/s") || what.contains("Gb/s") || what.contains(" / ") { "" } else { " s" };
    let m = median(times.to_vec()).filter(|_| times.len() >= MIN_SAMPLES);
    let lost = runs - times.len().min(runs);
    println!(
        "xtask: bench: {what}: median {} over {} of {runs} runs ({}){}",
        m.map_or(format!("n/a (fewer than {MIN_SAMPLES} samples)"), |m| if count {
            format!("{m:.0}")
        } else {
            format!("{m:.4}{unit}")
        }),
        times.len(),
        times
            .iter()
            .map(|t| match (count, unit.is_empty()) {
                (true, _) => format!("{t:.0}"),
                (false, true) => format!("{t:.3}"),
                (false, false) => format!("{t:.2}"),
            })
            .collect::<Vec<_>>()
            .join(", "),
        if lost > 0 { format!("; {lost} sample(s) lost") } else { String::new() }
    );
    m
}

/// The share of a run's time to KTAP that the hypervisor under this host stole, averaged
/// over the host's CPUs: a run that lost a tenth of its time was slowed by the host, not
/// by what it ran.
fn steal_share(r: &VmResult) -> Option<f64> {
    let (time, steal) = (r.time_to_ktap?.as_secs_f64(), r.host_steal?.as_secs_f64());
    (time > 0.0).then(|| steal / (time * gdrvm_harness::host_cpus() as f64))
}

/// Prints each run's [`steal_share`] in run order, where the host reports steal.
fn print_steal(label: &str, runs: &[&VmResult]) {
    let shares: Vec<String> =
        runs.iter().map(|r| steal_share(r).map_or("-".into(), |s| format!("{:.0}%", s * 100.0))).collect();
    if runs.iter().any(|r| r.host_steal.is_some()) {
        println!("xtask: bench: {label:<18} host steal, share of each run's time: {}", shares.join(", "));
    }
}

/// Prints the interval of the median of `ratios` and what it says of `target` (the most
/// the ratio may be): met (all of the interval at or below it), missed (all of it above),
/// or not resolved (the rounds' spread is wider than the distance to it).
fn print_interval(ratios: Vec<f64>, target: f64) {
    match median_interval(ratios) {
        Some((lo, hi, coverage)) => println!(
            "xtask: bench:   its median lies in [{lo:.3}, {hi:.3}] ({:.1}% interval): target <= {target:.2} {}",
            coverage * 100.0,
            if hi <= target {
                "met"
            } else if lo > target {
                "missed"
            } else {
                "not resolved at this spread: more rounds, or a quieter host"
            }
        ),
        None => println!("xtask: bench:   no interval for that median: fewer than 6 rounds gave a figure"),
    }
}

/// Prints gdrvm's time and exits over `qemu`'s round by round (the two booted back to
/// back, so the host's drift, which moves both, cancels in each round's ratio), each
/// with its median's interval against the target. The ratios of medians above are the
/// issue's figures; these say how far the noise lets them be trusted.
fn print_paired_ratios(results: &[VmResult], rounds: usize, qemu: &str) {
    let find = |name: &str, round: usize| results.iter().find(|r| r.name == format!("{name} #{round}"));
    let paired = |of: fn(&VmResult) -> Option<f64>| -> Vec<f64> {
        (0..rounds)
            .filter_map(|round| {
                let (g, q) = (of(find("gdrvm", round)?)?, of(find(qemu, round)?)?);
                (q > 0.0).then(|| g / q)
            })
            .collect()
    };
    let time = |r: &VmResult| r.time_to_ktap.map(|d| d.as_secs_f64());
    for (what, ratios, target) in [("time", paired(time), TIME_TARGET), ("exits", paired(exits_to_ktap), EXITS_TARGET)]
    {
        print_median(&format!("{what} ratio gdrvm / {qemu}, paired by round"), &ratios, rounds);
        print_interval(ratios, target);
    }
    // Steal inflates a time, not a count: the time ratio again over the quiet rounds.
    let pairs: Vec<(AgentRun, AgentRun)> = (0..rounds)
        .filter_map(|round| Some((AgentRun::of(find("gdrvm", round)?)?, AgentRun::of(find(qemu, round)?)?)))
        .collect();
    print_quiet_ratio(&format!("time ratio gdrvm / {qemu}"), &pairs, rounds, Some(TIME_TARGET));
}

/// The exits KVM counted for a run's VM until its first KTAP line.
fn exits_to_ktap(r: &VmResult) -> Option<f64> {
    r.kvm_exits.as_ref()?.total().map(|t| t as f64)
}

/// Prints every L1 failure the runs went through (each cost a restart and a rerun).
fn print_l1_incidents(results: &[VmResult]) {
    for r in results {
        for i in &r.l1_incidents {
            println!("xtask: bench: {}: {}", r.name, i.summary());
        }
    }
}

/// Says why a run gave no time to its first KTAP line: what went wrong, the first line
/// that mentions KTAP (the time is taken at an exact `KTAP version 1` line, so a header
/// cut or run into another line gives none) and the console's last lines.
fn print_no_ktap(r: &VmResult) {
    let problem = r.problem().unwrap_or_else(|| "no exact `KTAP version 1` line".into());
    println!("xtask: bench: {} gave no KTAP: {problem}", r.name);
    if let Some(line) = r.console.iter().find(|l| l.contains("KTAP")) {
        println!("xtask: bench:   first line mentioning KTAP: {line:?}");
    }
    for line in r.tail().iter().rev().take(5).rev() {
        println!("  | {line}");
    }
}

/// The command line of every boot-bench VM: the same kernel, initramfs and command line
/// for every VMM; no suites, so the agent prints its KTAP header as soon as it starts.
const BOOT_CMDLINE: &str = "console=ttyS0 quiet panic=-1 gdrvm.suites=";
/// The vfio bench's: the agent's `barbench` suite times guest reads of the BAR.
const BARBENCH_CMDLINE: &str = "console=ttyS0 quiet panic=-1 gdrvm.suites=barbench";
/// The net bench's: the `rdma` suite's TCP stream and ib_write_bw between the nodes.
const NET_CMDLINE: &str = "console=ttyS0 quiet panic=-1 tsc=reliable gdrvm.suites=rdma";
/// The profile run's: the kernel times every initcall into a log buffer big enough to keep
/// them all (the console stays quiet), and the agent's `profile` suite reports.
const PROFILE_CMDLINE: &str = "console=ttyS0 quiet panic=-1 initcall_debug log_buf_len=4M gdrvm.suites=profile";

/// The order of `items` in round `round`: as given in even rounds, reversed in odd ones,
/// so that no run always follows the same one. Nested, what ran before matters: the
/// first writes to memory the last VM freed also pay for dropping the emulator's
/// translations of that VM's code (measured in one L1: gdrvm's setup took 140 ms after a
/// job that had only touched memory, 430-650 ms after another guest), and the first run
/// of all meets an L1 whose own code is not translated yet.
fn round_order<T>(items: &[T], round: usize) -> Vec<&T> {
    let mut order: Vec<&T> = items.iter().collect();
    if round % 2 == 1 {
        order.reverse();
    }
    order
}

/// The boot bench's runs: every contender once a round, in [`round_order`].
fn specs(artifacts: &Artifacts, rounds: usize, cmdline: &str) -> Vec<VmSpec> {
    (0..rounds)
        .flat_map(|round| {
            round_order(&CONTENDERS, round).into_iter().map(move |(name, vmm)| VmSpec {
                name: format!("{name} #{round}"),
                vmm: *vmm,
                image: artifacts.guest_for(cmdline),
                node: None,
                cluster: None,
                cmdline: cmdline.into(),
                cpus: 2,
                memory: "1G".into(),
                timeout: Duration::from_secs(180),
            })
        })
        .collect()
}

/// How many exit kinds the boot bench lists per VMM.
const TOP_KINDS: usize = 5;

/// One VMM's boot figures: medians over its runs.
struct BootFigures {
    name: &'static str,
    time: Option<f64>,
    exits: Option<f64>,
}

/// Prints one VMM's time and exits to the first KTAP line, and its top exit kinds.
fn boot_figures(name: &'static str, mine: &[&VmResult]) -> BootFigures {
    let times: Vec<f64> = mine.iter().filter_map(|r| r.time_to_ktap.map(|d| d.as_secs_f64())).collect();
    for r in mine.iter().filter(|r| r.time_to_ktap.is_none()) {
        print_no_ktap(r);
    }
    let time = print_median(&format!("{name:<16} time to first KTAP line"), &times, mine.len());
    print_steal(name, mine);
    let counted: Vec<&KvmExits> = mine.iter().filter_map(|r| r.kvm_exits.as_ref()).collect();
    let totals: Vec<f64> = counted.iter().filter_map(|e| e.total()).map(|t| t as f64).collect();
    // Printed from any number of runs; a ratio needs MIN_SAMPLES.
    let shown = median(totals.clone());
    let exits = shown.filter(|_| totals.len() >= MIN_SAMPLES);
    match shown {
        Some(m) => {
            // Each kind's median over the runs, the largest first.
            let kinds = median_by_kind(counted.iter().flat_map(|e| e.kinds()));
            let top: Vec<String> =
                kinds.iter().take(TOP_KINDS).map(|(k, n)| format!("{k} {n:.0}")).collect();
            println!(
                "xtask: bench: {name:<16} exits to first KTAP line: median {m:.0} over {} of {} runs ({}); top kinds: {}",
                totals.len(),
                mine.len(),
                totals.iter().map(|t| format!("{t:.0}")).collect::<Vec<_>>().join(", "),
                top.join(", ")
            );
        }
        None => println!(
            "xtask: bench: {name:<16} exits to first KTAP line: n/a (no run counted; KVM's counters need debugfs and root)"
        ),
    }
    print_exit_reasons(name, mine);
    BootFigures { name, time, exits }
}

/// How many exit reasons and MSRs the boot bench lists per VMM.
const TOP_REASONS: usize = 8;

/// Prints a VMM's exits by reason and its MSR accesses by register (medians over its
/// runs), where L1's tracepoint histograms counted them.
fn print_exit_reasons(name: &str, mine: &[&VmResult]) {
    let reasons: Vec<&ExitReasons> = mine.iter().filter_map(|r| r.exit_reasons.as_ref()).collect();
    if reasons.is_empty() {
        return;
    }
    let top = |kinds: Vec<(&str, f64)>| {
        kinds.iter().take(TOP_REASONS).map(|(k, n)| format!("{k} {n:.0}")).collect::<Vec<_>>().join(", ")
    };
    println!(
        "xtask: bench: {name:<16} exits by reason (median over {} runs): {}",
        reasons.len(),
        top(median_by_kind(reasons.iter().flat_map(|r| r.reasons())))
    );
    println!("xtask: bench: {name:<16} MSR accesses: {}", top(median_by_kind(reasons.iter().flat_map(|r| r.msrs()))));
    println!(
        "xtask: bench: {name:<16} CPUID leaf/subleaf: {}",
        top(median_by_kind(reasons.iter().flat_map(|r| r.cpuid_leaves())))
    );
}

/// How many exit sites the boot bench lists per VMM.
const TOP_SITES: usize = 15;

/// Prints where in the guest a VMM's exits came from: per reason and guest function (as L1
/// named them, where the guest ran L1's kernel), the mean over its runs. Addresses L1 could
/// not name are told as firmware or user space by their range.
fn print_exit_sites(name: &str, mine: &[&VmResult]) {
    let (runs, by_site) = mean_exit_sites(mine);
    if by_site.is_empty() {
        return;
    }
    let mut sites: Vec<_> = by_site.into_iter().collect();
    sites.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    println!("xtask: bench: {name:<16} exit sites (mean over {runs} runs; exits, reason, guest function):");
    for ((reason, place), n) in sites.iter().take(TOP_SITES) {
        println!("xtask: bench:   {n:>7.0} {reason:<18} {place}");
    }
}

/// Each exit site's mean count (reason, and place as [`site_place`] tells it) over the
/// runs of `mine` that L1's histograms counted, and how many runs those were.
fn mean_exit_sites<'a>(mine: &[&'a VmResult]) -> (usize, BTreeMap<(&'a str, &'a str), f64>) {
    let reasons: Vec<&ExitReasons> = mine.iter().filter_map(|r| r.exit_reasons.as_ref()).collect();
    let mut by_site = BTreeMap::new();
    for r in &reasons {
        for (reason, place, n) in r.sites() {
            *by_site.entry((reason, site_place(place))).or_insert(0.0) += n as f64 / reasons.len() as f64;
        }
    }
    (reasons.len(), by_site)
}

/// An exit site's place as printed: the guest function L1 named, or for an address L1 could
/// not name, the kind of code its range holds.
fn site_place(place: &str) -> &str {
    match place.strip_prefix("0x").and_then(|a| u64::from_str_radix(a, 16).ok()) {
        Some(a) if a < 1 << 20 => "below 1 MiB (real-mode firmware)",
        Some(a) if a < 1 << 32 => "below 4 GiB (firmware, or a non-PIE user program)",
        Some(a) if a < KERNEL_MAP => "user space",
        _ => place,
    }
}

/// Each kind's median count over the runs that reported it, the largest first.
fn median_by_kind<'a>(counts: impl Iterator<Item = (&'a str, u64)>) -> Vec<(&'a str, f64)> {
    let mut by_kind: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for (kind, n) in counts {
        by_kind.entry(kind).or_default().push(n as f64);
    }
    let mut kinds: Vec<(&str, f64)> = by_kind.into_iter().filter_map(|(k, v)| Some((k, median(v)?))).collect();
    kinds.sort_by(|a, b| b.1.total_cmp(&a.1));
    kinds
}

/// Prints gdrvm's figure over the best QEMU's as a ratio against its target.
/// Without a figure from every QEMU the best one is unknown (a slower QEMU would stand in
/// for a faster one that lost runs), so the ratio is n/a, naming the QEMU short of samples.
fn print_ratio(what: &str, figures: &[BootFigures], of: fn(&BootFigures) -> Option<f64>, target: &str) {
    if let Some(short) = figures[1..].iter().find(|f| of(f).is_none()) {
        println!("xtask: bench: {what} ratio n/a ({} has fewer than {MIN_SAMPLES} samples)", short.name);
        return;
    }
    let best = figures[1..].iter().filter_map(|f| Some((f.name, of(f)?))).min_by(|a, b| a.1.total_cmp(&b.1));
    match (of(&figures[0]), best) {
        (Some(g), Some((qname, q))) if q > 0.0 => {
            println!("xtask: bench: {what} ratio gdrvm / best QEMU ({qname}) = {:.2} (target {target})", g / q)
        }
        _ => println!("xtask: bench: {what} ratio n/a (a VMM has fewer than {MIN_SAMPLES} samples)"),
    }
}

/// Runs the boot benchmark and prints its figures; with `profile`, one more run of each VMM
/// with initcall timing, and where each boot's time went, side by side.
pub async fn boot(runner: &Runner, rounds: usize, profile: bool) -> Result<()> {
    if rounds < 1 {
        bail!("--rounds must be at least 1");
    }
    println!(
        "xtask: bench boot: {rounds} rounds of {} VMMs, alternating (reversed every other round), {:?} runner",
        CONTENDERS.len(),
        runner.kind
    );
    let mut all = specs(&runner.artifacts, rounds, BOOT_CMDLINE);
    if profile {
        let mut profiled = specs(&runner.artifacts, 1, PROFILE_CMDLINE);
        for s in &mut profiled {
            s.name = s.name.replace(" #0", " profile");
        }
        all.extend(profiled);
    }
    let results = runner.run(&all).await?;
    let figures: Vec<BootFigures> = CONTENDERS
        .iter()
        .map(|(name, _)| {
            let mine: Vec<&VmResult> = results.iter().filter(|r| r.name.starts_with(&format!("{name} #"))).collect();
            boot_figures(name, &mine)
        })
        .collect();
    for (name, _) in CONTENDERS {
        let mine: Vec<&VmResult> = results.iter().filter(|r| r.name.starts_with(&format!("{name} #"))).collect();
        print_exit_sites(name, &mine);
    }
    print_l1_incidents(&results);
    print_ratio("time", &figures, |f| f.time, &format!("<= {TIME_TARGET}, goal 0.5"));
    print_ratio("exits", &figures, |f| f.exits, &format!("<= {EXITS_TARGET}"));
    let fastest = figures[1..].iter().filter_map(|f| Some((f.name, f.time?))).min_by(|a, b| a.1.total_cmp(&b.1));
    if let Some((qemu, _)) = fastest {
        print_paired_ratios(&results, rounds, qemu);
    }
    print_gdrvm_stats(results.iter().filter(|r| r.name.starts_with("gdrvm #")).collect());
    if profile {
        print_profiles(&results, &CONTENDERS.map(|(name, _)| name));
    }
    Ok(())
}

/// gdrvm's own figures: setup by phase, the exits it served by kind and device, RSS.
fn print_gdrvm_stats(runs: Vec<&VmResult>) {
    let stats: Vec<&GdrvmStats> = runs.iter().filter_map(|r| r.stats.as_ref()).collect();
    let setup: Vec<f64> = stats.iter().filter_map(|s| s.setup_us).map(|us| us as f64 / 1000.0).collect();
    println!(
        "xtask: bench: gdrvm setup (process start to first KVM_RUN): median {} (target < 10 ms on real KVM)",
        median(setup).map_or("n/a".into(), |m| format!("{m:.1} ms"))
    );
    for (name, ms) in phase_medians(&stats) {
        println!("xtask: bench:   setup phase {name:<36} median {ms:.2} ms");
    }
    let kinds = median_by_kind(stats.iter().flat_map(|s| s.vmm_exit_kinds.iter().map(|(k, n)| (k.as_str(), *n))));
    let served: Vec<f64> = stats.iter().map(|s| s.vmm_exits as f64).collect();
    println!(
        "xtask: bench: gdrvm exits served by the VMM (to power-off): median {}; by device: {}",
        median(served).map_or("n/a".into(), |m| format!("{m:.0}")),
        kinds.iter().take(8).map(|(k, n)| format!("{k} {n:.0}")).collect::<Vec<_>>().join(", ")
    );
    let imaged: Vec<f64> = stats.iter().map(|s| s.config_images as f64).collect();
    println!(
        "xtask: bench: gdrvm functions whose configuration reads cost no exit (images mapped read-only in ECAM): median {}",
        median(imaged).map_or("n/a".into(), |m| format!("{m:.0}"))
    );
    let rss: Vec<f64> = stats.iter().filter_map(|s| s.rss_beyond_guest_kib).map(|k| k as f64 / 1024.0).collect();
    println!(
        "xtask: bench: gdrvm RSS beyond guest RAM: median {} (target < 5 MiB)",
        median(rss).map_or("n/a".into(), |m| format!("{m:.1} MiB"))
    );
}

/// Each setup phase's median in ms over `stats`, in the order the phases ran.
fn phase_medians<'a>(stats: &[&'a GdrvmStats]) -> Vec<(&'a str, f64)> {
    let mut phases: Vec<(&str, Vec<f64>)> = Vec::new();
    for s in stats {
        for (name, us) in &s.phases {
            match phases.iter_mut().find(|p| p.0 == name) {
                Some(p) => p.1.push(*us as f64 / 1000.0),
                None => phases.push((name, vec![*us as f64 / 1000.0])),
            }
        }
    }
    phases.into_iter().map(|(name, ms)| (name, median(ms).unwrap_or(0.0))).collect()
}

/// The `profile| ` diagnostics of one run, as their words.
fn profile_lines(r: &VmResult) -> Vec<Vec<String>> {
    r.console
        .iter()
        .filter_map(|l| l.split_once("profile| ").map(|(_, rest)| rest.split(' ').map(str::to_owned).collect()))
        .collect()
}

/// The profile lines of several runs of one guest as one: each figure (milestone, initcall,
/// interrupt count, totals) the median over the runs that reported it, the rest (silences,
/// CPU flags) as the first run has them.
fn merged_profile(runs: &[Vec<Vec<String>>]) -> Vec<Vec<String>> {
    const FIGURES: [&str; 4] = ["milestone", "initcall", "initcalls", "interrupts"];
    let mut merged: Vec<Vec<String>> = Vec::new();
    let mut values: Vec<Vec<f64>> = Vec::new();
    for w in runs.iter().flatten().filter(|w| w.len() > 2 && FIGURES.contains(&w[0].as_str())) {
        let Ok(v) = w[1].parse::<f64>() else { continue };
        match merged.iter().position(|m| m[0] == w[0] && m[2..] == w[2..]) {
            Some(i) => values[i].push(v),
            None => {
                merged.push(w.clone());
                values.push(vec![v]);
            }
        }
    }
    for (m, v) in merged.iter_mut().zip(values) {
        let integer = !m[1].contains('.');
        let med = median(v).unwrap_or(0.0);
        m[1] = if integer { format!("{med:.0}") } else { format!("{med:.3}") };
    }
    if let Some(first) = runs.first() {
        merged.extend(first.iter().filter(|w| !w.is_empty() && !FIGURES.contains(&w[0].as_str())).cloned());
    }
    merged
}

/// Prints the profile runs of each of `labels` side by side (runs named `LABEL profile`, or
/// `LABEL profile #N` for several, merged by [`merged_profile`]): milestones, initcall
/// totals, the slowest initcalls of any with each one's time for them, and each one's
/// longest silences.
fn print_profiles(results: &[VmResult], labels: &[&str]) {
    let runs: Vec<(&str, Vec<Vec<String>>)> = labels
        .iter()
        .filter_map(|label| {
            let name = format!("{label} profile");
            let mine: Vec<Vec<Vec<String>>> = results
                .iter()
                .filter(|r| r.name == name || r.name.starts_with(&format!("{name} #")))
                .map(profile_lines)
                .filter(|l| !l.is_empty())
                .collect();
            (!mine.is_empty()).then(|| (*label, merged_profile(&mine)))
        })
        .collect();
    if runs.iter().all(|(_, lines)| lines.is_empty()) {
        println!("xtask: bench: profile: no run reported a profile");
        return;
    }
    let header: String = runs.iter().map(|(n, _)| format!("{n:>16}")).collect();
    // `KIND VALUE KEY...` lines; a line too short to have a key is ignored.
    let value = |lines: &[Vec<String>], kind: &str, key: &str| -> Option<String> {
        lines.iter().find(|w| w.len() > 2 && w[0] == kind && w[2..].join(" ") == key).map(|w| w[1].clone())
    };
    // Every key of `kind` any run reported, in the order first seen.
    let keys = |kind: &str| -> Vec<String> {
        let mut keys: Vec<String> = Vec::new();
        for w in runs.iter().flat_map(|(_, lines)| lines).filter(|w| w.len() > 2 && w[0] == kind) {
            let key = w[2..].join(" ");
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        keys
    };
    println!("xtask: bench: profile: milestones (seconds of kernel time){header}");
    for n in &keys("milestone") {
        let row: String =
            runs.iter().map(|(_, l)| format!("{:>16}", value(l, "milestone", n).unwrap_or("-".into()))).collect();
        println!("xtask: bench: profile:   {n:<36}{row}");
    }
    let totals: String = runs
        .iter()
        .map(|(_, l)| {
            let t = l.iter().find(|w| w[0] == "initcalls" && w.len() > 2);
            format!(
                "{:>16}",
                t.map_or("-".into(), |w| format!("{} ms/{}", w[1].parse::<u64>().unwrap_or(0) / 1000, w[2]))
            )
        })
        .collect();
    println!("xtask: bench: profile:   {:<36}{totals}", "initcalls (total time/count)");
    let mut calls = keys("initcall");
    let slowest =
        |f: &String| runs.iter().filter_map(|(_, l)| value(l, "initcall", f)?.parse::<u64>().ok()).max().unwrap_or(0);
    calls.sort_by_key(|f| std::cmp::Reverse(slowest(f)));
    println!("xtask: bench: profile: slowest initcalls (µs){header}");
    for f in calls.iter().take(30) {
        let row: String =
            runs.iter().map(|(_, l)| format!("{:>16}", value(l, "initcall", f).unwrap_or("-".into()))).collect();
        println!("xtask: bench: profile:   {:<36}{row}", f.chars().take(36).collect::<String>());
    }
    let sources = keys("interrupts");
    if !sources.is_empty() {
        println!("xtask: bench: profile: interrupts to the agent (all CPUs){header}");
        for n in &sources {
            let row: String =
                runs.iter().map(|(_, l)| format!("{:>16}", value(l, "interrupts", n).unwrap_or("-".into()))).collect();
            println!("xtask: bench: profile:   {n:<36}{row}");
        }
    }
    for (name, lines) in &runs {
        for w in lines.iter().filter(|w| w[0] == "gap" && w.len() > 3).take(5) {
            println!("xtask: bench: profile: {name}: silent {} s before {} s: {}", w[1], w[2], w[3..].join(" "));
        }
    }
    print_cpu_flag_differences(&runs);
}

/// Prints the CPU features each QEMU guest saw that gdrvm's did not, and the reverse: the
/// same kernel picks its string copies, checksums and ciphers by them.
fn print_cpu_flag_differences(runs: &[(&str, Vec<Vec<String>>)]) {
    let flags = |lines: &[Vec<String>]| -> Option<Vec<String>> {
        lines.iter().find(|w| w.len() > 1 && w[0] == "cpuflags").map(|w| w[2..].to_vec())
    };
    let Some(((first, _), mine)) = runs.first().and_then(|r| Some((r, flags(&r.1)?))) else {
        return;
    };
    for (name, lines) in &runs[1..] {
        let Some(theirs) = flags(lines) else { continue };
        let only = |a: &[String], b: &[String]| -> String {
            let d: Vec<&str> = a.iter().filter(|f| !b.contains(f)).map(String::as_str).collect();
            if d.is_empty() {
                "none".into()
            } else {
                d.join(" ")
            }
        };
        println!(
            "xtask: bench: profile: CPU flags only {first} shows: {}; only {name} shows: {}",
            only(&mine, &theirs),
            only(&theirs, &mine)
        );
    }
}

/// The nodes `bench topology` compares, in the order even rounds run them.
const NODES: [&str; 2] = ["vela-a100", "minimal"];

/// Runs the topology benchmark and prints its figures: the two nodes with every endpoint
/// hollow, the tree's own cost (config accesses, ACPI namespace, bridges and ports), which
/// the target is for; and the nodes as their presets have them, with their emulators
/// (ten endpoints against two), for what a user waits for. The emulators' own cost is
/// `bench p2p`'s. vela-a100 hollow also boots with all of it on one NUMA node, as minimal
/// has: the two hollow nodes differ in NUMA layout as well as in tree, and at the bench's
/// 2 vCPUs vela-a100's two nodes get one vCPU each. Linux before 6.5 runs unbound work on
/// the queuing CPU's node, so the guest's asynchronous work (the initramfs unpacking among
/// it: 0.34 s against minimal's 0.14 s in `--profile`) shares the boot CPU instead of
/// running beside it. That pair splits the difference into the tree's part and the
/// layout's.
///
/// With `profile`, also [`PROFILE_ROUNDS`] runs of each hollow node with initcall timing,
/// and where each one's boot went, side by side (medians over those runs).
pub async fn topology(runner: &Runner, rounds: usize, profile: bool) -> Result<()> {
    println!(
        "xtask: bench topology: {rounds} rounds of {NODES:?}, hollow and as preset, order reversed every other \
         round, {:?} runner",
        runner.kind
    );
    let mut nodes = Vec::new();
    for name in NODES {
        nodes.push((format!("{name} hollow"), hollow(name)?));
    }
    nodes.extend(NODES.map(|name| (name.to_owned(), name.to_owned())));
    nodes.push((format!("{} hollow, one NUMA node", NODES[0]), on_one_numa_node(&nodes[0].1)?));
    let labelled: Vec<(&str, String)> = nodes.iter().map(|(l, n)| (l.as_str(), n.clone())).collect();
    let profiled = if profile { &labelled[..2] } else { &[] };
    let (times, results) = time_to_agent(runner, rounds, &labelled, profiled).await?;
    times.print_ratio("ratio vela-a100 / minimal, hollow (the tree; target <= 1.10)", 0, 1, Some(1.10));
    times.print_ratio("ratio vela-a100 / minimal, as preset (tree and emulators)", 2, 3, None);
    times.print_ratio("ratio vela-a100 on one NUMA node / minimal, hollow (the tree's part)", 4, 1, None);
    times.print_ratio("ratio vela-a100 / vela-a100 on one NUMA node, hollow (the layout's part)", 0, 4, None);
    print_tree_cost(&results, &nodes[0].0, &nodes[1].0);
    if profile {
        print_profiles(&results, &[&nodes[0].0, &nodes[1].0]);
    }
    Ok(())
}

/// How many profile runs of each node `bench topology --profile` adds (their initcall
/// times spread by tens of percent from one run to the next).
const PROFILE_ROUNDS: usize = 3;

/// How many exit sites `bench topology` lists where the bigger tree exits more.
const TOP_TREE_SITES: usize = 12;

/// Where the bigger tree's time goes, from the runs labelled `big` and `small` (the hollow
/// pair): KVM's exits to the agent and their paired ratio (a count, not noisy as a time
/// is), gdrvm's setup and the exits it served, and the guest code whose exits grew most.
fn print_tree_cost(results: &[VmResult], big: &str, small: &str) {
    let of = |label: &str| -> Vec<&VmResult> {
        results.iter().filter(|r| r.name.starts_with(&format!("{label} #"))).collect()
    };
    let (b, s) = (of(big), of(small));
    for (label, runs) in [(big, &b), (small, &s)] {
        let totals: Vec<f64> = runs.iter().filter_map(|r| exits_to_ktap(r)).collect();
        print_median(&format!("{label:<18} exits to agent"), &totals, runs.len());
        let setup: Vec<f64> =
            runs.iter().filter_map(|r| r.stats.as_ref()?.setup_us).map(|us| us as f64 / 1000.0).collect();
        let served: Vec<f64> = runs.iter().filter_map(|r| r.stats.as_ref()).map(|s| s.vmm_exits as f64).collect();
        println!(
            "xtask: bench: {label:<18} setup median {} ({}), exits served by gdrvm to power-off median {}",
            median(setup.clone()).map_or("n/a".into(), |m| format!("{m:.0} ms")),
            setup.iter().map(|ms| format!("{ms:.0}")).collect::<Vec<_>>().join(", "),
            median(served).map_or("n/a".into(), |m| format!("{m:.0}"))
        );
        print_exit_reasons(label, runs);
    }
    let (stats_b, stats_s): (Vec<&GdrvmStats>, Vec<&GdrvmStats>) =
        (b.iter().filter_map(|r| r.stats.as_ref()).collect(), s.iter().filter_map(|r| r.stats.as_ref()).collect());
    let (pb, ps) = (phase_medians(&stats_b), phase_medians(&stats_s));
    println!("xtask: bench: setup phases, median ms: {big} / {small}");
    for (name, ms) in &pb {
        let other = ps.iter().find(|p| p.0 == *name).map_or("-".into(), |p| format!("{:.1}", p.1));
        println!("xtask: bench:   {name:<44} {ms:>8.1} {other:>8}");
    }
    let paired: Vec<f64> = b
        .iter()
        .filter_map(|rb| {
            let round = rb.name.rsplit_once('#')?.1;
            let rs = s.iter().find(|r| r.name.rsplit_once('#').map(|(_, n)| n) == Some(round))?;
            Some(exits_to_ktap(rb)? / exits_to_ktap(rs)?)
        })
        .collect();
    print_median(&format!("exits ratio {big} / {small}, paired by round"), &paired, b.len());
    let ((_, sb), (_, ss)) = (mean_exit_sites(&b), mean_exit_sites(&s));
    let mut grown: Vec<(&(&str, &str), f64)> =
        sb.iter().map(|(k, n)| (k, n - ss.get(k).copied().unwrap_or(0.0))).filter(|(_, d)| *d >= 1.0).collect();
    if grown.is_empty() {
        return;
    }
    grown.sort_by(|x, y| y.1.total_cmp(&x.1));
    let total: f64 = grown.iter().map(|(_, d)| d).sum();
    println!("xtask: bench: exit sites where {big} exits more than {small} (means; {total:.0} more in all):");
    for ((reason, place), d) in grown.iter().take(TOP_TREE_SITES) {
        println!("xtask: bench:   {d:>+7.0} {reason:<18} {place}");
    }
}

/// One run's time to the agent (seconds) and its [`steal_share`].
#[derive(Debug, Clone, Copy, PartialEq)]
struct AgentRun {
    time: f64,
    steal: Option<f64>,
}

impl AgentRun {
    /// `r`'s time to its first KTAP line and its steal share; none where it gave no time.
    fn of(r: &VmResult) -> Option<AgentRun> {
        Some(AgentRun { time: r.time_to_ktap?.as_secs_f64(), steal: steal_share(r) })
    }
}

/// Times to the agent: for each node booted, in the order asked, its run in each round
/// (none where the run gave no time).
struct AgentTimes(Vec<Vec<Option<AgentRun>>>);

/// The most a run may lose to the host's steal for its round to count as one the host
/// left alone.
const STEAL_LIMIT: f64 = 0.05;

impl AgentTimes {
    /// Prints the median over the rounds of node `a`'s time over node `b`'s in the same
    /// round. The host's speed drifts by tens of percent within minutes here, more than
    /// the differences measured: two runs of one round ran close together (their order
    /// reversed every other round), so the drift cancels in their ratio, not in a ratio
    /// of medians taken over all rounds. Steal does not cancel: it comes in bursts of
    /// seconds, and took 0-42% of single runs' time in one run of this bench. So where
    /// the host reports steal, the ratio is also given over the rounds in which neither
    /// run lost more than [`STEAL_LIMIT`] of its time to it.
    ///
    /// With a `target` (the most the ratio may be), also [`print_interval`]'s verdict, for
    /// both.
    fn print_ratio(&self, what: &str, a: usize, b: usize, target: Option<f64>) {
        let pairs: Vec<(AgentRun, AgentRun)> =
            self.0[a].iter().zip(&self.0[b]).filter_map(|(x, y)| Some(((*x)?, (*y)?))).collect();
        let ratios: Vec<f64> = pairs.iter().map(|(x, y)| x.time / y.time).collect();
        print_median(what, &ratios, self.0[a].len());
        if let Some(target) = target {
            print_interval(ratios, target);
        }
        print_quiet_ratio(&format!("  {what}"), &pairs, self.0[a].len(), target);
    }
}

/// Where the host reports steal, prints the ratio of each round's pair of runs again over
/// the rounds it left alone ([`quiet_ratios`]), out of `rounds`, with `target`'s verdict.
fn print_quiet_ratio(what: &str, pairs: &[(AgentRun, AgentRun)], rounds: usize, target: Option<f64>) {
    if pairs.iter().all(|(x, y)| x.steal.is_none() && y.steal.is_none()) {
        return;
    }
    let quiet = quiet_ratios(pairs);
    print_median(
        &format!("{what}, rounds the host left alone (steal <= {:.0}% in both runs)", STEAL_LIMIT * 100.0),
        &quiet,
        rounds,
    );
    if let Some(target) = target {
        print_interval(quiet, target);
    }
}

/// The ratios of the rounds (pairs of runs) in which both runs lost at most
/// [`STEAL_LIMIT`] of their time to the host's steal.
fn quiet_ratios(pairs: &[(AgentRun, AgentRun)]) -> Vec<f64> {
    let calm = |r: &AgentRun| r.steal.is_some_and(|s| s <= STEAL_LIMIT);
    pairs.iter().filter(|(x, y)| calm(x) && calm(y)).map(|(x, y)| x.time / y.time).collect()
}

/// Boots the agent with no suite on each of `nodes` (label, preset or file) in each of
/// `rounds` rounds (2 vCPUs, 1 GiB), in the order given in even rounds and the reverse in
/// odd ones, so that no node always follows the same one; then [`PROFILE_ROUNDS`] profile
/// runs (`LABEL profile #N`) of each of `profiled`, alternating. Prints each node's median
/// time to the agent and returns every time, and every run's result.
async fn time_to_agent(
    runner: &Runner,
    rounds: usize,
    nodes: &[(&str, String)],
    profiled: &[(&str, String)],
) -> Result<(AgentTimes, Vec<VmResult>)> {
    if rounds < 1 {
        bail!("--rounds must be at least 1");
    }
    let name = |label: &str, round: usize| format!("{label} #{round}");
    let spec = |name: String, node: &str, cmdline: &str| VmSpec {
        name,
        vmm: Vmm::Gdrvm,
        image: runner.artifacts.guest_for(cmdline),
        node: Some(node.to_owned()),
        cluster: None,
        cmdline: cmdline.into(),
        cpus: 2,
        memory: "1G".into(),
        timeout: Duration::from_secs(180),
    };
    let mut specs: Vec<VmSpec> = (0..rounds)
        .flat_map(|round| {
            round_order(nodes, round).into_iter().map(move |(label, node)| spec(name(label, round), node, BOOT_CMDLINE))
        })
        .collect();
    for round in 0..PROFILE_ROUNDS {
        for (label, node) in profiled {
            specs.push(spec(format!("{label} profile #{round}"), node, PROFILE_CMDLINE));
        }
    }
    let results = runner.run(&specs).await?;
    let mut times = Vec::new();
    for (label, _) in nodes {
        let runs: Vec<Option<&VmResult>> =
            (0..rounds).map(|round| results.iter().find(|r| r.name == name(label, round))).collect();
        let mine: Vec<Option<AgentRun>> = runs.iter().map(|r| r.and_then(AgentRun::of)).collect();
        let got: Vec<f64> = mine.iter().flatten().map(|r| r.time).collect();
        print_median(&format!("{label:<18} time to agent"), &got, rounds);
        print_steal(label, &runs.into_iter().flatten().collect::<Vec<_>>());
        times.push(mine);
    }
    print_l1_incidents(&results);
    results.iter().filter(|r| r.time_to_ktap.is_none()).for_each(print_no_ktap);
    Ok((AgentTimes(times), results))
}

/// The two ways `bench vfio` reaches ivshmem's BAR, in the order each round runs them.
const BAR_ACCESS: [&str; 2] = ["mapped", "trapped"];

/// vfio-lab with every BAR of `mem0` trapped, written under `target/gdrvm/bench`.
fn trapped_lab() -> Result<String> {
    let text = gdrvm_model::node::Node::preset_text("vfio-lab").ok_or_else(|| anyhow::anyhow!("no vfio-lab preset"))?;
    let text = text.replacen("name = \"mem0\"\n", "name = \"mem0\"\ntrap_bars = true\n", 1);
    let dir = gdrvm_harness::gdrvm_dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("vfio-lab-trapped.toml");
    std::fs::write(&path, text)?;
    Ok(path.display().to_string())
}

/// The figure after `key` in a diagnostic of the guest's barbench check (`ram_read 812.3 MB/s`).
fn figure(r: &VmResult, key: &str) -> Option<f64> {
    let suite = r.ktap.suites.iter().find(|s| s.name == "barbench")?;
    suite
        .cases
        .iter()
        .flat_map(|c| &c.diagnostics)
        .find_map(|d| d.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
}

/// Runs the VFIO BAR benchmark: in the vfio-lab L1, the guest reads ivshmem's BAR2 mapped
/// and trapped, each against its own RAM in the same run.
pub async fn vfio(runner: &Runner, rounds: usize) -> Result<()> {
    if rounds < 1 {
        bail!("--rounds must be at least 1");
    }
    let trapped = trapped_lab()?;
    println!("xtask: bench vfio: {rounds} rounds of ivshmem BAR2 reads, mapped and trapped, {:?} runner", runner.kind);
    let specs: Vec<VmSpec> = (0..rounds)
        .flat_map(|round| {
            let trapped = trapped.clone();
            BAR_ACCESS.iter().map(move |access| VmSpec {
                name: format!("{access} #{round}"),
                vmm: Vmm::Gdrvm,
                image: runner.artifacts.guest_for(BARBENCH_CMDLINE),
                node: Some(if *access == "mapped" { "vfio-lab".to_owned() } else { trapped.clone() }),
                cluster: None,
                cmdline: BARBENCH_CMDLINE.into(),
                cpus: 1,
                memory: "1G".into(),
                timeout: Duration::from_secs(180),
            })
        })
        .collect();
    let results = runner.run(&specs).await?;
    let mut ratios = Vec::new();
    for access in BAR_ACCESS {
        let mine: Vec<&VmResult> = results.iter().filter(|r| r.name.starts_with(&format!("{access} #"))).collect();
        for r in mine.iter().filter(|r| figure(r, "bar/ram").is_none()) {
            println!("xtask: bench: {} gave no figure: {}", r.name, r.problem().unwrap_or_default());
        }
        let of = |key: &str| -> Vec<f64> { mine.iter().filter_map(|r| figure(r, key)).collect() };
        print_median(&format!("{access:<8} BAR2 read MB/s"), &of("bar_read"), mine.len());
        print_median(&format!("{access:<8} RAM read MB/s (same guest)"), &of("ram_read"), mine.len());
        ratios.push((access, print_median(&format!("{access:<8} BAR2 / RAM"), &of("bar/ram"), mine.len())));
    }
    print_l1_incidents(&results);
    match (ratios[0].1, ratios[1].1) {
        (Some(m), Some(t)) => println!(
            "xtask: bench: mapped BAR reads at {m:.3} of RAM speed, trapped at {t:.5}; mapped / trapped = {:.0}",
            m / t
        ),
        _ => println!("xtask: bench: ratio n/a (fewer than {MIN_SAMPLES} samples of a kind)"),
    }
    Ok(())
}

/// Preset `name` with every endpoint hollow (`backing = "none"`), written under
/// `target/gdrvm/bench`: the tree without what stands behind it.
fn hollow(name: &str) -> Result<String> {
    let text = gdrvm_model::node::Node::preset_text(name).ok_or_else(|| anyhow::anyhow!("no {name} preset"))?;
    let text = text.replace("backing = \"emulated-gpu\"\n", "").replace("backing = \"emulated-nic\"\n", "");
    let node = gdrvm_model::node::Node::parse(name, &text)?;
    if let Some(f) = node.functions.iter().find(|f| !matches!(f.backing, gdrvm_model::node::Backing::None)) {
        bail!("{name}: endpoint {} still has a backing after hollowing (a preset backing bench does not know)", f.key);
    }
    let dir = gdrvm_harness::gdrvm_dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{name}-hollow.toml"));
    std::fs::write(&path, text)?;
    Ok(path.display().to_string())
}

/// The node file at `path` with all of its NUMA nodes made one (their vCPUs and RAM
/// summed, every host bridge on it), written beside it as `NAME-one-numa.toml`; the path.
fn on_one_numa_node(path: &str) -> Result<String> {
    let text = std::fs::read_to_string(path)?;
    let mut node: toml::Table = toml::from_str(&text)?;
    let numa = node.get("numa").and_then(toml::Value::as_array).cloned().unwrap_or_default();
    let (mut cpus, mut memory) = (0i64, 0u64);
    for n in &numa {
        cpus += n.get("cpus").and_then(toml::Value::as_integer).unwrap_or(0);
        let size = n.get("memory").and_then(toml::Value::as_str).unwrap_or("");
        memory += gdrvm_model::parse_size(size).ok_or_else(|| anyhow::anyhow!("{path}: numa memory {size:?}"))?;
    }
    let mut one = toml::Table::new();
    one.insert("cpus".into(), cpus.into());
    one.insert("memory".into(), memory.to_string().into());
    node.insert("numa".into(), toml::Value::Array(vec![one.into()]));
    for (_, entries) in node.iter_mut() {
        let Some(entries) = entries.as_array_mut() else { continue };
        for entry in entries.iter_mut().filter_map(toml::Value::as_table_mut) {
            if let Some(n) = entry.get_mut("numa") {
                *n = 0.into();
            }
        }
    }
    let name = format!("{}-one-numa", node.get("name").and_then(toml::Value::as_str).unwrap_or("node"));
    node.insert("name".into(), name.clone().into());
    let text = toml::to_string(&node)?;
    gdrvm_model::node::Node::parse(&name, &text)?;
    let path = std::path::Path::new(path).with_file_name(format!("{name}.toml"));
    std::fs::write(&path, text)?;
    Ok(path.display().to_string())
}

/// Runs the p2p criterion benchmark (emulated DMA against memcpy, trapped emulator
/// register against an in-VMM one; its own output is the report), then vela-a100 booted
/// with its emulators against the same tree hollow.
pub async fn p2p(runner: &Runner, rounds: usize) -> Result<()> {
    println!("xtask: bench p2p: criterion, emulated NIC DMA into an emulated GPU BAR against memcpy (target >= 0.70)");
    let status = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["bench", "-p", "gdrvm-devices", "--bench", "p2p", "--", "--noplot"])
        .status()?;
    if !status.success() {
        bail!("cargo bench failed: {status}");
    }
    let hollow = hollow("vela-a100")?;
    println!(
        "xtask: bench p2p: {rounds} rounds of vela-a100 emulated and hollow, order reversed every other round, {:?} runner",
        runner.kind
    );
    let nodes = [("vela-a100 emulated", "vela-a100".to_owned()), ("vela-a100 hollow", hollow)];
    time_to_agent(runner, rounds, &nodes, &[]).await?.0.print_ratio(
        "ratio emulated / hollow (target <= 1.15)",
        0,
        1,
        Some(1.15),
    );
    Ok(())
}

/// The VMMs the net benchmark compares, each running the two-node cluster.
const NET_CONTENDERS: [(&str, bool); 2] = [("gdrvm", false), ("qemu", true)];

/// The last figure in Gb/s on a console line of node a that mentions `what`.
fn gbits(r: &VmResult, what: &str) -> Option<f64> {
    r.console.iter().filter(|l| l.starts_with("[a] ") && l.contains(what)).find_map(|l| {
        let before = l.split("Gb/s").next()?;
        before.split_whitespace().last()?.parse().ok()
    })
}

/// Runs `cargo xtask bench net`: the two-node cluster under gdrvm (virtio-net on its
/// userspace wire) and under QEMU (virtio-net-pci on a unix `dgram` netdev), alternating,
/// same kernel, initramfs and guest size; the rdma suite's TCP stream and ib_write_bw
/// figures, medians and ratios gdrvm / QEMU.
pub async fn net(runner: &Runner, rounds: usize) -> Result<()> {
    if rounds < 1 {
        bail!("--rounds must be at least 1");
    }
    println!("xtask: bench net: {rounds} rounds of two-node, gdrvm and QEMU alternating, {:?} runner", runner.kind);
    let specs: Vec<VmSpec> = (0..rounds)
        .flat_map(|round| {
            NET_CONTENDERS.iter().map(move |(name, qemu)| VmSpec {
                name: format!("{name} #{round}"),
                vmm: Vmm::Gdrvm,
                image: runner.artifacts.guest_for(NET_CMDLINE),
                node: None,
                cluster: Some(ClusterSpec { cluster: "two-node".into(), kill: None, qemu: *qemu }),
                cmdline: NET_CMDLINE.into(),
                cpus: 1,
                memory: "768M".into(),
                timeout: Duration::from_secs(240),
            })
        })
        .collect();
    // Every job in an L1 of its own: QEMU as L2's VMM has been seen to bring L1 down
    // (see the shared ARCHITECTURE.md), and a damaged L1 must not cost the next job.
    let mut results = Vec::new();
    for spec in &specs {
        results.extend(runner.run(std::slice::from_ref(spec)).await?);
    }
    let mut medians = Vec::new();
    for (name, _) in NET_CONTENDERS {
        let mine: Vec<&VmResult> = results.iter().filter(|r| r.name.starts_with(&format!("{name} #"))).collect();
        for r in mine.iter().filter(|r| gbits(r, "tcp_stream").is_none() || gbits(r, "ib_write_bw").is_none()) {
            println!(
                "xtask: bench: {} gave no figure: {}; what its VMMs said, and its last lines:",
                r.name,
                r.problem().unwrap_or_default()
            );
            let said = r.console.iter().filter(|l| l.contains("] gdrvm:") || l.contains("WARN"));
            for line in said.chain(r.tail()) {
                println!("  | {line}");
            }
        }
        let of = |what: &str| -> Vec<f64> { mine.iter().filter_map(|r| gbits(r, what)).collect() };
        let tcp = print_median(&format!("{name:<6} TCP stream Gb/s"), &of("tcp_stream"), mine.len());
        let ib = print_median(&format!("{name:<6} ib_write_bw Gb/s"), &of("ib_write_bw"), mine.len());
        medians.push((tcp, ib));
    }
    print_l1_incidents(&results);
    let ratio = |g: Option<f64>, q: Option<f64>| match (g, q) {
        (Some(g), Some(q)) if q > 0.0 => format!("{:.3}", g / q),
        _ => format!("n/a (fewer than {MIN_SAMPLES} samples of a kind)"),
    };
    println!("xtask: bench: TCP gdrvm / QEMU = {} (target >= 1.0)", ratio(medians[0].0, medians[1].0));
    println!("xtask: bench: ib_write_bw gdrvm / QEMU = {} (target >= 1.0)", ratio(medians[0].1, medians[1].1));
    Ok(())
}

/// Runs the ECAM criterion benchmark (its own output is the report).
pub fn ecam() -> Result<()> {
    println!("xtask: bench ecam: criterion, per access, VM exit excluded (target <= 100 ns)");
    let status = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["bench", "-p", "gdrvm", "--bench", "ecam", "--", "--noplot"])
        .status()?;
    if !status.success() {
        bail!("cargo bench failed: {status}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_round_order_reverses_every_other_round_so_no_run_always_follows_the_same() {
        let names: Vec<&str> = CONTENDERS.iter().map(|(n, _)| *n).collect();
        let runs: Vec<&str> = (0..4).flat_map(|r| round_order(&names, r)).copied().collect();
        assert_eq!(&runs[..3], ["gdrvm", "qemu -M pc", "qemu -M microvm"]);
        assert_eq!(&runs[3..6], ["qemu -M microvm", "qemu -M pc", "gdrvm"]);
        // gdrvm's predecessors over the rounds: nothing, QEMU pc, gdrvm, QEMU pc.
        let before_gdrvm: Vec<&str> = (1..runs.len()).filter(|&i| runs[i] == "gdrvm").map(|i| runs[i - 1]).collect();
        assert_eq!(before_gdrvm, ["qemu -M pc", "gdrvm", "qemu -M pc"]);
    }

    #[test]
    fn test_steal_share_spreads_the_steal_over_the_hosts_cpus() {
        let mut r = VmResult::new("r", gdrvm_harness::VmOutcome::Exited(0), Vec::new(), Duration::from_secs(5));
        r.time_to_ktap = Some(Duration::from_secs(4));
        assert_eq!(steal_share(&r), None, "no steal where the host reports none");
        r.host_steal = Some(Duration::from_secs_f64(0.8 * gdrvm_harness::host_cpus() as f64));
        assert!((steal_share(&r).unwrap() - 0.2).abs() < 1e-9);
    }

    #[test]
    fn test_quiet_ratios_keep_the_rounds_where_neither_run_lost_time_to_steal() {
        let run = |time, steal| AgentRun { time, steal };
        let pairs = [
            (run(2.0, Some(0.01)), run(1.0, Some(0.0))),
            (run(3.0, Some(0.30)), run(1.0, Some(0.0))),
            (run(1.5, Some(0.0)), run(1.0, Some(0.06))),
            (run(1.2, None), run(1.0, Some(0.0))),
            (run(1.1, Some(0.05)), run(1.0, Some(0.05))),
        ];
        assert_eq!(quiet_ratios(&pairs), [2.0, 1.1]);
    }

    #[test]
    fn test_median() {
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
    }

    #[test]
    fn test_median_interval_takes_the_order_statistics_the_binomial_allows() {
        let samples = |n: usize| (1..=n).rev().map(|i| i as f64).collect::<Vec<f64>>();
        assert_eq!(median_interval(samples(5)), None, "min and max of 5 cover 93.75%");
        // 6 samples: min and max, 1 - 2/64.
        assert_eq!(median_interval(samples(6)), Some((1.0, 6.0, 1.0 - 2.0 / 64.0)));
        // 9: the 2nd smallest and largest, 1 - 2 * 10/512 = 96.1%.
        let (lo, hi, c) = median_interval(samples(9)).unwrap();
        assert_eq!((lo, hi), (2.0, 8.0));
        assert!((c - (1.0 - 20.0 / 512.0)).abs() < 1e-12);
        // 11: P(B <= 2) = 67/2048, twice that is 6.5%, too much: the 2nd again.
        assert_eq!(median_interval(samples(11)).map(|(l, h, _)| (l, h)), Some((2.0, 10.0)));
        // 20: P(B <= 5) = 21700/2^20, twice that is 4.1%: the 6th.
        assert_eq!(median_interval(samples(20)).map(|(l, h, _)| (l, h)), Some((6.0, 15.0)));
        assert_eq!(median_interval(Vec::new()), None);
    }

    #[test]
    fn test_on_one_numa_node_keeps_the_tree_and_sums_the_layout() {
        use gdrvm_model::node::Node;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vela-a100-hollow.toml");
        let text = Node::preset_text("vela-a100").unwrap();
        std::fs::write(&path, text).unwrap();
        let one = on_one_numa_node(path.to_str().unwrap()).unwrap();
        assert_eq!(one, dir.path().join("vela-a100-one-numa.toml").display().to_string());
        let (before, after) =
            (Node::parse("a", text).unwrap(), Node::parse("b", &std::fs::read_to_string(&one).unwrap()).unwrap());
        assert_eq!(after.name, "vela-a100-one-numa");
        assert_eq!(after.numa.len(), 1);
        assert_eq!(after.numa[0].cpus, before.numa.iter().map(|n| n.cpus).sum::<u32>());
        assert_eq!(after.numa[0].memory, before.numa.iter().map(|n| n.memory).sum::<u64>());
        assert!(before.host_bridges.iter().any(|hb| hb.numa == 1));
        assert!(after.host_bridges.iter().all(|hb| hb.numa == 0));
        // The same tree: every function at the same address with the same identity.
        let tree = |n: &Node| n.functions.iter().map(|f| format!("{} {}", f.bdf, f.key)).collect::<Vec<_>>();
        assert_eq!(tree(&after), tree(&before));
    }

    #[test]
    fn test_merged_profile_takes_each_figures_median_and_the_first_runs_other_lines() {
        let words = |lines: &[&str]| -> Vec<Vec<String>> {
            lines.iter().map(|l| l.split(' ').map(str::to_owned).collect()).collect()
        };
        let runs = [
            words(&["milestone 0.500 ACPI up", "initcall 200000 acpi_init", "gap 0.2 0.9 first", "interrupts 600 LOC"]),
            words(&[
                "milestone 0.700 ACPI up",
                "initcall 100000 acpi_init",
                "gap 0.3 1.0 second",
                "interrupts 700 LOC",
            ]),
            words(&["milestone 0.600 ACPI up", "initcall 150000 acpi_init", "initcall 9000 pci_arch_init"]),
        ];
        let merged = merged_profile(&runs);
        let line = |l: &[String]| l.join(" ");
        let lines: Vec<String> = merged.iter().map(|l| line(l)).collect();
        assert_eq!(
            lines,
            [
                "milestone 0.600 ACPI up",
                "initcall 150000 acpi_init",
                "interrupts 650 LOC",
                "initcall 9000 pci_arch_init",
                "gap 0.2 0.9 first",
            ],
            "medians (fractions keep three places, counts none), a figure one run reported as it is, \
             silences from the first run only"
        );
        assert!(merged_profile(&[]).is_empty());
    }
}
