//! The agent as the guest's PID 1: set up the minimum of a system, load the image's
//! modules, run the suites the kernel command line names (or a shell), report and power off.

use std::path::Path;
use std::process::Command;

use gdrvm_model::DEBUG_EXIT_PORT;

use crate::context::Context;
use crate::{ktap, modalias, suites, sys};

/// What the kernel command line asks of the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitOptions {
    /// Suites to run (`gdrvm.suites=a,b`); [`gdrvm_model::DEFAULT_SUITES`] when not given.
    pub suites: Vec<String>,
    /// Start a shell on the console instead of running suites (`gdrvm.shell`).
    pub shell: bool,
    /// Act as L1 of a nested run: run gdrvm jobs instead of suites (`gdrvm.l1`).
    pub l1: bool,
}

impl InitOptions {
    /// Parses `/proc/cmdline`.
    pub fn from_cmdline(cmdline: &str) -> Self {
        InitOptions {
            suites: gdrvm_model::cmdline_suites(cmdline),
            shell: gdrvm_model::cmdline_shell(cmdline),
            l1: cmdline.split_whitespace().any(|w| w == "gdrvm.l1"),
        }
    }
}

/// What the agent writes into the kernel log once it runs as PID 1 (its file systems
/// mounted), for the `profile` suite's milestones.
pub const MARK_STARTED: &str = "gdrvm-agent: started";
/// What it writes once the image's modules are loaded.
pub const MARK_MODULES: &str = "gdrvm-agent: modules loaded";

/// Runs PID 1's whole life. Never returns.
pub fn run() -> ! {
    for (source, target, fstype) in
        [("proc", "/proc", "proc"), ("sysfs", "/sys", "sysfs"), ("devtmpfs", "/dev", "devtmpfs")]
    {
        if let Err(e) = sys::mount(source, target, fstype) {
            println!("# gdrvm-agent: cannot mount {target}: {e}");
        }
    }
    sys::mark(MARK_STARTED);
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let opts = InitOptions::from_cmdline(&cmdline);
    let status = match Context::load(Path::new("/"), Ok(String::new()), Vec::new()) {
        Ok(ctx) => {
            let ModulesLoaded { errors: module_errors, left_out: modules_left_out } = load_modules(&ctx);
            sys::mark(MARK_MODULES);
            if let Err(why) = load_user_modules(&ctx) {
                // What the user's driver was to be tested by cannot run: 125, as `git
                // bisect run` reads it (skip this commit), with the kernel's words.
                println!("# gdrvm-agent: cannot test: {why}");
                println!("KTAP version 1\n1..0 # SKIP {why}");
                finish(CANNOT_TEST);
            }
            if opts.l1 {
                crate::l1::run()
            } else if opts.shell {
                shell()
            } else {
                let kernel_log = sys::kernel_log().map_err(|e| e.to_string());
                let ctx = Context { kernel_log, module_errors, modules_left_out, ..ctx };
                report(&opts.suites, &ctx)
            }
        }
        Err(e) => {
            println!("# gdrvm-agent: unreadable input: {e}");
            println!("KTAP version 1\n1..0 # SKIP agent inputs unreadable");
            1
        }
    };
    finish(status)
}

/// Runs `suites`, prints KTAP, returns the exit status (0 all passed, 1 otherwise).
pub fn report(names: &[String], ctx: &Context) -> u8 {
    let reports: Vec<_> = names.iter().map(|n| suites::run(n, ctx)).collect();
    print_paced(&ktap::render(&reports));
    u8::from(!reports.iter().all(|r| r.passed()))
}

/// Bytes written to the console between waits for it to drain.
const CONSOLE_PACE: usize = 2048;

/// Prints `text`, waiting (tcdrain) every [`CONSOLE_PACE`] bytes until a terminal on
/// stdout has sent what it was given. A guest's serial port sends from its interrupt, one
/// VM exit a byte: fed tens of KiB at once (a sysfs recording), the CPU taking that
/// interrupt did nothing else for half a minute and the kernel reported an RCU stall into
/// the output. Where stdout is no terminal (bare metal, a pipe) nothing waits.
fn print_paced(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let mut since = 0;
    for line in text.split_inclusive('\n') {
        let _ = out.write_all(line.as_bytes());
        since += line.len();
        if since >= CONSOLE_PACE {
            let _ = out.flush();
            // SAFETY: tcdrain on fd 1 only waits; it fails harmlessly (ENOTTY) on a pipe.
            unsafe { libc::tcdrain(1) };
            since = 0;
        }
    }
    let _ = out.flush();
}

/// The parameters the kernel command line gives module `name` (`name.param=value` words,
/// as modprobe passes them), in `param=value` form. Dashes and underscores in the module
/// name are the same.
fn module_params(cmdline: &str, name: &str) -> String {
    let name = name.replace('-', "_");
    cmdline
        .split_whitespace()
        .filter_map(|w| {
            let (module, param) = w.split_once('.')?;
            (module.replace('-', "_") == name && param.contains('=')).then_some(param)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The image's modules at boot: what failed and what was left out.
#[derive(Debug, Default)]
struct ModulesLoaded {
    /// The errors of required modules.
    errors: Vec<String>,
    /// Modules left out: each drives devices none of which is here, or only such
    /// modules need it.
    left_out: Vec<String>,
}

/// Loads the image's modules, each with its parameters from the kernel command line.
/// Optional modules that fail (hardware-specific ones on other hardware) are only logged.
/// A module, required or optional, that drives PCI or virtio devices none of which is
/// here is left out, and so is every module only such modules need, unless a module
/// loaded on demand or the user's depends on it ([`modalias::left_out`]); a note in the
/// kernel log names each.
fn load_modules(ctx: &Context) -> ModulesLoaded {
    let Some(image) = &ctx.image else { return ModulesLoaded::default() };
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let stem = |m: &String| Path::new(m).file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = |m: &String| modalias::module_name(&stem(m));
    let load = |m: &String| {
        sys::load_module(Path::new(m), &module_params(&cmdline, &stem(m)))
            .err()
            .map(|e| format!("cannot load {m}: {e}"))
    };
    let present = modalias::pci_modaliases(Path::new("/sys/bus/pci/devices"));
    let info = |m: &String| modalias::ModInfo::read(Path::new(m)).unwrap_or_default();
    let at_boot: Vec<(String, modalias::ModInfo)> =
        image.modules.iter().chain(&image.optional_modules).map(|m| (name(m), info(m))).collect();
    let needed_elsewhere: std::collections::HashSet<String> =
        image.on_demand_modules.iter().chain(&image.user_modules).flat_map(|m| info(m).depends).collect();
    let out = modalias::left_out(&at_boot, &present, &needed_elsewhere);
    let mut loaded = ModulesLoaded::default();
    for (m, required) in
        image.modules.iter().map(|m| (m, true)).chain(image.optional_modules.iter().map(|m| (m, false)))
    {
        if out.contains(&name(m)) {
            sys::mark(&format!(
                "gdrvm-agent: {} not loaded: no device here that it or a module needing it drives",
                name(m)
            ));
            loaded.left_out.push(name(m));
            continue;
        }
        match load(m) {
            Some(e) if required => loaded.errors.push(e),
            Some(e) => println!("# gdrvm-agent: {e} (optional)"),
            None => {}
        }
    }
    loaded
}

/// Exit status of a guest that cannot test (the harness's and `git bisect run`'s 125).
const CANNOT_TEST: u8 = 125;

/// Loads the user's out-of-tree modules (`--module-src`) after the image's own; the first
/// that fails is the error, with what the kernel logged about it.
fn load_user_modules(ctx: &Context) -> Result<(), String> {
    let Some(image) = &ctx.image else { return Ok(()) };
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    for m in &image.user_modules {
        let name = Path::new(m).file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        if let Err(e) = sys::load_module(Path::new(m), &module_params(&cmdline, &name)) {
            let log = sys::kernel_log().unwrap_or_default();
            let said: Vec<&str> = log.lines().filter(|l| l.contains(&name)).collect();
            let said = said.iter().rev().take(3).rev().map(|l| l.trim()).collect::<Vec<_>>().join(" | ");
            return Err(format!(
                "module {name} does not load: {e}{}",
                if said.is_empty() { String::new() } else { format!("; the kernel said: {said}") }
            ));
        }
        println!("# gdrvm-agent: loaded {m}");
    }
    Ok(())
}

fn shell() -> u8 {
    println!("gdrvm-agent: shell on the console; 'poweroff -f' or exit to stop the VM");
    match Command::new("/bin/sh").env("PATH", "/bin:/sbin:/usr/bin:/usr/sbin").env("HOME", "/").status() {
        Ok(status) => u8::try_from(status.code().unwrap_or(1)).unwrap_or(1),
        Err(e) => {
            println!("gdrvm-agent: cannot start /bin/sh: {e}");
            1
        }
    }
}

fn finish(status: u8) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    if let Err(e) = sys::write_port(DEBUG_EXIT_PORT, status) {
        println!("# gdrvm-agent: cannot report status {status} on the debug-exit port: {e}");
    }
    let err = sys::power_off();
    println!("# gdrvm-agent: power off failed: {err}");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_cmdline_options() {
        let o = InitOptions::from_cmdline("console=ttyS0 quiet gdrvm.suites=smoke,topology panic=-1");
        assert_eq!(o, InitOptions { suites: vec!["smoke".into(), "topology".into()], shell: false, l1: false });
        assert!(InitOptions::from_cmdline("console=ttyS0 gdrvm.l1").l1);
        let cmdline = "quiet e1000e.IntMode=0,0 e1000e.debug=3 vfio-pci.ids=1234:11e8 gdrvm.suites=vfio";
        assert_eq!(module_params(cmdline, "e1000e"), "IntMode=0,0 debug=3");
        assert_eq!(module_params(cmdline, "vfio_pci"), "ids=1234:11e8");
        assert_eq!(module_params(cmdline, "virtio_net"), "");
        let o = InitOptions::from_cmdline("quiet gdrvm.shell");
        assert!(o.shell);
        assert_eq!(o.suites, vec!["smoke".to_string()]);
    }
}
