//! `memgov top`: the machine ledger of one device, live. A table of every
//! process on it (name, pid, slot, priority, floor, limit, charged, used,
//! cached, contexts, bytes given back through the doorbell, rings not
//! answered, and the variable a limit the cluster granted came from; under
//! each process, its largest call sites by live bytes, from its contexts
//! with attribution on), under
//! the ledger's totals (limit, charged, outside memgov, available), redrawn
//! in place every interval; `--once` prints it once, `--json` prints one
//! snapshot as JSON, `--prometheus` prints it in Prometheus's text format
//! (node-exporter's textfile form). When the key names a device by
//! UUID or PCI address and the vendor's management library (NVML) is
//! there, the processes on the device that have no slot on the ledger are
//! listed under the table, with what the library says each uses. It opens
//! the segment read-only in effect: it creates nothing and changes nothing
//! unless `--sweep`, `--repair` or `--reset` asks it to.

use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct TopArgs {
    /// The device key: the ledger at /dev/shm/memgov-<key> (the key as the
    /// processes joined it: `gpu-<uuid>`, `pci-<address>`, a name).
    #[arg(long, default_value = "host:0")]
    device: String,
    /// The segment's file, when the processes were given one.
    #[arg(long)]
    path: Option<PathBuf>,
    /// Print one snapshot as JSON and exit.
    #[arg(long)]
    json: bool,
    /// Print the ledger once in Prometheus's text format and exit: the
    /// form node-exporter's textfile collector reads
    /// (`memgov top --prometheus > memgov.prom`; docs/metrics.md).
    #[arg(long)]
    prometheus: bool,
    /// Print the table once and exit.
    #[arg(long)]
    once: bool,
    /// Milliseconds between refreshes.
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// Reclaim the slots of processes that died before showing the ledger.
    #[arg(long)]
    sweep: bool,
    /// Rebuild the ledger's total from its slots (after a check found them
    /// apart), then show it.
    #[arg(long)]
    repair: bool,
    /// Remove the segment (corrupt, or of another layout version) and exit.
    /// Refused while live processes use it (they are named): stop them
    /// first, since they would keep the old one.
    #[arg(long)]
    reset: bool,
    /// With --reset: remove it even though processes seem to use it (they
    /// are gone but the ledger cannot tell: another pid namespace, a dead
    /// machine).
    #[arg(long, requires = "reset")]
    force: bool,
    /// The ledger is shared with a group (LedgerOptions::shared): accept a
    /// segment of another owner, or writable by its group.
    #[arg(long)]
    shared: bool,
}

pub fn main(args: &TopArgs) -> ExitCode {
    let path = args
        .path
        .clone()
        .unwrap_or_else(|| memgov::machine::default_path(&args.device));
    if args.reset {
        let reset = if args.force {
            memgov::machine::MachineLedger::force_reset(&path)
        } else {
            memgov::machine::MachineLedger::reset(&path)
        };
        return match reset {
            Ok(()) => {
                println!("removed {}", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => fail(args.json, &e.to_string()),
        };
    }
    if matches!(path.try_exists(), Ok(false)) {
        return no_ledger(args, &path);
    }
    let opened = if args.shared {
        memgov::machine::MachineLedger::open_existing_shared(&path)
    } else {
        memgov::machine::MachineLedger::open_existing(&path)
    };
    let ledger = match opened {
        Ok(l) => l,
        Err(e) => return fail(args.json, &for_the_command_line(&e.to_string())),
    };
    if args.sweep {
        for r in ledger.sweep() {
            eprintln!(
                "reclaimed slot {} of '{}' (pid {}, dead): {} back",
                r.slot,
                printable(&r.name),
                r.pid,
                short(r.bytes)
            );
        }
    }
    if args.repair {
        let (before, after) = ledger.repair();
        eprintln!("repaired: total {} -> {}", short(before), short(after));
    }
    if args.json {
        let snap = ledger.snapshot();
        let mut v = serde_json::to_value(&snap).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            o.insert("available".into(), snap.available().into());
            match outside_processes(&snap) {
                Ok(list) => {
                    let list: Vec<_> = list
                        .iter()
                        .map(|(p, name)| {
                            serde_json::json!({"pid": p.pid, "name": name, "bytes": p.bytes})
                        })
                        .collect();
                    o.insert("outside_process_list".into(), list.into());
                }
                Err(why) => {
                    o.insert("outside_process_list".into(), serde_json::Value::Null);
                    o.insert("outside_process_list_missing".into(), why.into());
                }
            }
            o.insert(
                "consistent".into(),
                ledger
                    .check()
                    .map_or_else(|e| e.to_string().into(), |()| true.into()),
            );
        }
        println!("{v:#}");
        return ExitCode::SUCCESS;
    }
    if args.prometheus {
        let figures = memgov::metrics::LedgerFigures::read(&ledger);
        print!(
            "{}",
            memgov::metrics::textfile(&memgov::metrics::render_ledgers(&[figures], 0))
        );
        return ExitCode::SUCCESS;
    }
    if args.once {
        print!("{}", view(&ledger));
        return ExitCode::SUCCESS;
    }
    loop {
        // Home, clear to the end: the table redraws in place.
        print!("\x1b[H\x1b[J{}", view(&ledger));
        use std::io::Write;
        let _ = std::io::stdout().flush();
        std::thread::sleep(Duration::from_millis(args.interval_ms.max(50)));
    }
}

/// The processes on the device without a slot on the ledger, with their
/// names from `/proc`, as the management library reports them; or why
/// there is no such list.
fn outside_processes(
    snap: &memgov::machine::MachineSnapshot,
) -> Result<Vec<(memgov::machine::DeviceProcess, String)>, String> {
    let id = memgov::DeviceIdentity::from_key(&snap.key).ok_or_else(|| {
        format!(
            "the key '{}' names no device by UUID or PCI address",
            snap.key
        )
    })?;
    let found = memgov::machine::device_processes(&id).map_err(|e| e.to_string())?;
    Ok(snap
        .processes_outside(&found)
        .into_iter()
        .map(|p| {
            let name = std::fs::read_to_string(format!("/proc/{}/comm", p.pid))
                .map_or_else(|_| "?".to_owned(), |n| n.trim().to_owned());
            (p, name)
        })
        .collect())
}

/// `text` with every control character (C0, DEL, C1: what a terminal
/// could take for an escape sequence) written as a `\u{..}` escape: names
/// come from other processes (slot names, `/proc/<pid>/comm` of any user).
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

fn view(ledger: &memgov::machine::MachineLedger) -> String {
    use std::fmt::Write;
    let snap = ledger.snapshot();
    let mut out = String::new();
    if let Err(e) = ledger.verify() {
        let _ = writeln!(out, "WARNING: {}", printable(&e.to_string()));
    }
    out.push_str(&table(&snap));
    match outside_processes(&snap) {
        Ok(list) if list.is_empty() => {
            out.push_str("no process outside memgov on the device\n");
        }
        Ok(list) => {
            let _ = writeln!(out, "outside memgov on the device:");
            for (p, name) in list {
                let bytes = p.bytes.map_or_else(|| "unknown".to_owned(), short);
                let _ = writeln!(out, "{:>8} {:<20} {:>9}", p.pid, printable(&name), bytes);
            }
        }
        Err(why) => {
            let _ = writeln!(out, "processes outside memgov: not listed ({why})");
        }
    }
    out
}

/// A ledger found in a directory: its key (read from the segment, or from
/// the file's name when it cannot be opened) and the flag that shows it.
struct Found {
    key: String,
    path: PathBuf,
    /// `--device KEY` for a segment at its default path, `--path FILE`
    /// otherwise.
    show: String,
}

/// The ledgers (`memgov-*` segments) in `dir`, sorted by file name.
fn ledgers_in(dir: &std::path::Path) -> Vec<Found> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<Found> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_owned();
            let from_name = name.strip_prefix("memgov-")?.to_owned();
            let path = e.path();
            let key = memgov::machine::MachineLedger::open_existing(&path)
                .map_or(from_name, |l| l.key().to_owned());
            let show = if memgov::machine::default_path(&key) == path {
                format!("--device {key}")
            } else {
                format!("--path {}", path.display())
            };
            Some(Found { key, path, show })
        })
        .collect();
    found.sort_by(|a, b| a.path.cmp(&b.path));
    found
}

/// No segment at `path`: no process has joined that key (or path). Say so,
/// list the ledgers that exist in the same directory, and how to show one.
fn no_ledger(args: &TopArgs, path: &std::path::Path) -> ExitCode {
    use std::fmt::Write;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let found = ledgers_in(dir);
    let mut error = match &args.path {
        None => format!(
            "no process has joined key '{}' (there is no ledger at {})",
            args.device,
            path.display()
        ),
        Some(p) => format!(
            "no process has joined a ledger at {} (there is no file there)",
            p.display()
        ),
    };
    if found.is_empty() {
        let _ = write!(
            error,
            "; ledgers on this machine in {}: none (a ledger appears when a process joins it)",
            dir.display()
        );
    } else {
        let _ = write!(error, "; ledgers on this machine in {}:", dir.display());
        for f in &found {
            let _ = write!(error, "\n  '{}': memgov top {}", f.key, f.show);
        }
    }
    let _ = write!(
        error,
        "\nshow a device's ledger with --device KEY (the key its processes joined, e.g. gpu-<uuid>), or a segment elsewhere with --path FILE"
    );
    if args.json {
        let ledgers: Vec<_> = found
            .iter()
            .map(|f| serde_json::json!({"key": f.key, "path": f.path, "show": f.show}))
            .collect();
        crate::print_json_error(&error, serde_json::json!({ "ledgers": ledgers }));
    }
    eprintln!("memgov top: {error}");
    ExitCode::from(1)
}

/// A ledger error worded for the command line: where the library's message
/// points at its options (`LedgerOptions::path`), the flag says it.
fn for_the_command_line(message: &str) -> String {
    message.replace("(LedgerOptions::path)", "(memgov top --path FILE)")
}

fn fail(json: bool, error: &str) -> ExitCode {
    if json {
        crate::print_json_error(error, serde_json::json!({}));
    }
    eprintln!("memgov top: {}", printable(error));
    ExitCode::from(1)
}

/// Bytes in at most 7 characters: `512 B`, `1.5 MiB`, `80.0 GiB`.
fn short(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    if bytes == u64::MAX {
        return "-".into();
    }
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn table(s: &memgov::machine::MachineSnapshot) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "memgov top: ledger '{}' ({}), layout {}, {} of {} slots in use",
        printable(&s.key),
        printable(&s.path),
        s.layout_version,
        s.processes.len(),
        s.slots
    );
    let observed = if s.observed_at_ms == 0 {
        "device never observed".to_owned()
    } else {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        format!(
            "device {} total, {} free, observed {:.1} s ago",
            short(s.device_total),
            short(s.device_free),
            now.saturating_sub(s.observed_at_ms) as f64 / 1000.0
        )
    };
    let _ = writeln!(
        out,
        "limit {}  charged {}  outside memgov {} ({} by processes the management library named)  available {}  ({observed}; {} dead processes reclaimed)",
        short(s.limit),
        short(s.charged),
        short(s.outside),
        short(s.outside_processes),
        short(s.available()),
        s.reclaims
    );
    let _ = writeln!(
        out,
        "{:>4} {:>8} {:<20} {:<8} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>4} {:>9} {:>5}  LIMIT FROM",
        "SLOT",
        "PID",
        "NAME",
        "STATE",
        "PRIO",
        "FLOOR",
        "LIMIT",
        "CHARGED",
        "USED",
        "CACHED",
        "CTX",
        "GAVE",
        "RINGS"
    );
    for p in &s.processes {
        let state = match (p.live, p.alive) {
            (true, true) => "live",
            (_, false) => "dead",
            (false, true) => "busy",
        };
        let mut name = printable(&p.name);
        if name.chars().count() > 20 {
            name = name.chars().take(19).collect::<String>() + "~";
        }
        let _ = writeln!(
            out,
            "{:>4} {:>8} {:<20} {:<8} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>4} {:>9} {:>5}  {}",
            p.slot,
            p.pid,
            name,
            state,
            p.priority,
            short(p.floor),
            short(p.limit),
            short(p.charged),
            short(p.used),
            short(p.cached),
            p.contexts,
            short(p.gave_back),
            p.unanswered_rings,
            p.limit_from.as_deref().unwrap_or("-")
        );
        // Its largest call sites (contexts with attribution on), under it.
        for site in &p.sites {
            let _ = writeln!(
                out,
                "{:>14} {:>9}  {}",
                "site",
                short(site.live_bytes),
                printable(&site.site)
            );
        }
    }
    if s.processes.is_empty() {
        out.push_str("(no process on the ledger)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{printable, short};

    #[test]
    fn control_characters_are_escaped() {
        // A name that would clear the screen and retitle the terminal.
        assert_eq!(
            printable("ev\u{1b}[2J\u{1b}]0;x\u{7}il\u{9b}1m\u{7f}"),
            "ev\\u{1b}[2J\\u{1b}]0;x\\u{7}il\\u{9b}1m\\u{7f}"
        );
        assert_eq!(printable("trainer-é"), "trainer-é");
    }

    #[test]
    fn bytes_fit_the_columns() {
        assert_eq!(short(512), "512 B");
        assert_eq!(short(1536 << 10), "1.5 MiB");
        assert_eq!(short(80 << 30), "80.0 GiB");
        assert_eq!(short(u64::MAX), "-");
    }
}
