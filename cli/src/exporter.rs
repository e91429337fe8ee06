//! `memgov exporter`: every machine ledger on the machine as a Prometheus
//! `/metrics` page. Each scrape lists the segment directory (`--dir`,
//! `/dev/shm` by default) for `memgov-*` segments, adds the segments named
//! with `--ledger`, opens each read-only in effect (nothing is created,
//! swept or changed) and renders their snapshots, with the processes the
//! device's management library (NVML, ROCm SMI) reports outside the
//! ledger, through `memgov::metrics::render_ledgers`. A ledger that
//! appears is on the next scrape; one that goes is gone from it. A file
//! that is not a readable ledger is left out of the page and counted in
//! `memgov_unreadable_segments`. Served by one thread over
//! `std::net`, one request at a time; `--once` prints the page and exits.

use clap::Args;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ExporterArgs {
    /// The address to serve `/metrics` on (loopback by default; give
    /// `0.0.0.0:9464` for Prometheus on another machine).
    #[arg(long, default_value = "127.0.0.1:9464", value_name = "ADDR")]
    listen: String,
    /// The directory whose `memgov-*` files are the machine's ledgers.
    #[arg(long, default_value = "/dev/shm", value_name = "DIR")]
    dir: PathBuf,
    /// A ledger's segment outside `--dir` (the path the processes were
    /// given); repeat for several.
    #[arg(long = "ledger", value_name = "PATH")]
    ledgers: Vec<PathBuf>,
    /// Print the page once on stdout and exit.
    #[arg(long)]
    once: bool,
}

pub fn main(args: &ExporterArgs) -> ExitCode {
    if args.once {
        print!("{}", page(args));
        return ExitCode::SUCCESS;
    }
    let listener = match TcpListener::bind(&args.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "memgov exporter: cannot listen on {}: {e}; pick a free address with --listen",
                args.listen
            );
            return ExitCode::from(1);
        }
    };
    let addr = listener
        .local_addr()
        .map_or_else(|_| args.listen.clone(), |a| a.to_string());
    println!("memgov exporter: serving http://{addr}/metrics");
    let _ = std::io::stdout().flush();
    for conn in listener.incoming() {
        match conn {
            Ok(conn) => {
                if let Err(e) = answer(conn, args) {
                    eprintln!("memgov exporter: a request failed: {e}");
                }
            }
            Err(e) => eprintln!("memgov exporter: accept failed: {e}"),
        }
    }
    ExitCode::SUCCESS
}

/// Every ledger's segment file: the `memgov-*` files in `dir`, then the
/// named paths, without repeats.
fn segments(args: &ExporterArgs) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(&args.dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with("memgov-"))
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    for p in &args.ledgers {
        if !found.iter().any(|f| same_file(f, p)) {
            found.push(p.clone());
        }
    }
    found
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// The page: every readable ledger, and the count of segments that were
/// not.
pub fn page(args: &ExporterArgs) -> String {
    let mut figures = Vec::new();
    let mut unreadable = 0u64;
    for path in segments(args) {
        match memgov::machine::MachineLedger::open_existing(&path) {
            Ok(l) => figures.push(memgov::metrics::LedgerFigures::read(&l)),
            // A named ledger that is not there yet is not an error: it
            // appears on the scrape after its first process creates it.
            Err(_) if !path.exists() => {}
            Err(e) => {
                unreadable += 1;
                eprintln!("memgov exporter: {} left out: {e}", path.display());
            }
        }
    }
    memgov::metrics::render_ledgers(&figures, unreadable)
}

fn answer(conn: TcpStream, args: &ExporterArgs) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    conn.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(&conn);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    let mut line = String::new();
    while reader.read_line(&mut line)? > 0 {
        if line == "\r\n" || line == "\n" {
            break;
        }
        line.clear();
    }
    let mut parts = request.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let mut conn = &conn;
    let (status, kind, body) = match (method, path) {
        ("GET", "/metrics") => ("200 OK", memgov::metrics::CONTENT_TYPE, page(args)),
        ("GET", "/") => (
            "200 OK",
            "text/html; charset=utf-8",
            "<html><body><a href=\"/metrics\">memgov metrics</a></body></html>\n".to_owned(),
        ),
        ("GET", _) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            format!("{path}: not here; the metrics are at /metrics\n"),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            format!("{method}: only GET is served\n"),
        ),
    };
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    conn.flush()
}
