//! `memgov exporter` over HTTP: `/metrics` lists the ledgers of `--dir` at
//! each request (one created after the exporter started is on the next
//! page, a removed one is gone), counts a file that is not a ledger, and
//! answers other paths with 404 and other methods with 405.
#![cfg(target_os = "linux")]

use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

struct Exporter(Child);

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(addr: &str, request: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.to_owned(), body.to_owned())
}

#[test]
fn the_page_follows_the_ledgers_of_the_directory() {
    let dir = std::env::temp_dir().join(format!("memgov-exporter-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let first =
        MachineLedger::open(&LedgerOptions::new("first", 1 << 30).path(dir.join("memgov-first")))
            .unwrap();
    let _m = first
        .join(JoinOptions::new("holder").lease_chunk(0))
        .unwrap();
    _m.charge(3 << 20).unwrap();
    std::fs::write(dir.join("memgov-not-a-ledger"), b"junk").unwrap();

    let mut child = Command::new(env!("CARGO_BIN_EXE_memgov"))
        .args(["exporter", "--listen", "127.0.0.1:0", "--dir"])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _exporter = Exporter(child);
    let addr = line
        .trim()
        .strip_prefix("memgov exporter: serving http://")
        .and_then(|a| a.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();

    let (head, body) = get(&addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(
        head.contains("Content-Type: application/openmetrics-text"),
        "{head}"
    );
    assert!(
        body.contains("memgov_process_charged_bytes{device=\"first\",process=\"holder\""),
        "{body}"
    );
    assert!(
        body.contains("memgov_ledger_charged_bytes{device=\"first\"} 3145728"),
        "{body}"
    );
    assert!(body.contains("memgov_unreadable_segments 1"), "{body}");
    assert!(!body.contains("device=\"second\""), "{body}");

    // A ledger created now is on the next page; a removed one is gone.
    let second =
        MachineLedger::open(&LedgerOptions::new("second", 1 << 30).path(dir.join("memgov-second")))
            .unwrap();
    let (_, body) = get(&addr, "GET /metrics HTTP/1.1\r\n\r\n");
    assert!(
        body.contains("memgov_ledger_limit_bytes{device=\"second\"} 1073741824"),
        "{body}"
    );
    drop(second);
    MachineLedger::reset(&dir.join("memgov-second")).unwrap();
    let (_, body) = get(&addr, "GET /metrics HTTP/1.1\r\n\r\n");
    assert!(!body.contains("device=\"second\""), "{body}");
    assert!(body.contains("device=\"first\""), "{body}");

    let (head, _) = get(&addr, "GET /nope HTTP/1.1\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    let (head, _) = get(&addr, "POST /metrics HTTP/1.1\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 405"), "{head}");
    let _ = std::fs::remove_dir_all(&dir);
}
