//! Steps of a tier: each one announced, timed, and stopped at on failure.

use std::borrow::BorrowMut;
use std::fmt;
use std::process::Command;
use std::time::Instant;

/// Why a tier stopped.
#[derive(Debug)]
pub enum Failure {
    /// The command line named no tier, or a tier without its argument.
    Usage(String),
    /// A step's command ran and failed.
    Step {
        /// The step, as announced.
        name: String,
        /// The command line, to run it again alone.
        command: String,
        /// Its exit status, or why it did not start.
        status: String,
    },
    /// Something the tier needs is not installed; the message says how to
    /// install it.
    Missing(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Usage(why) => f.write_str(why),
            Self::Step {
                name,
                command,
                status,
            } => {
                write!(
                    f,
                    "step `{name}` failed ({status}); rerun it alone with: {command}"
                )
            }
            Self::Missing(what) => write!(f, "not installed: {what}"),
        }
    }
}

/// The steps a tier has run so far, for its closing summary.
pub struct Steps {
    tier: String,
    start: Instant,
    done: Vec<String>,
}

impl Steps {
    /// No steps yet; the clock starts now.
    pub fn new(tier: &str) -> Self {
        Self {
            tier: tier.to_owned(),
            start: Instant::now(),
            done: Vec::new(),
        }
    }

    /// Runs `cmd` to completion with this process's output; a non-zero exit
    /// is the tier's failure.
    pub fn run(&mut self, name: &str, mut cmd: impl BorrowMut<Command>) -> Result<(), Failure> {
        let cmd = cmd.borrow_mut();
        let command = render(cmd);
        println!(
            "\n=== {name} ({}s): {command}",
            self.start.elapsed().as_secs()
        );
        let t0 = Instant::now();
        let status = cmd.status();
        let secs = t0.elapsed().as_secs();
        match status {
            Ok(s) if s.success() => {
                self.done.push(format!("{name}: passed in {secs}s"));
                Ok(())
            }
            Ok(s) => {
                self.done.push(format!("{name}: FAILED after {secs}s"));
                Err(Failure::Step {
                    name: name.to_owned(),
                    command,
                    status: s.to_string(),
                })
            }
            Err(e) => Err(Failure::Step {
                name: name.to_owned(),
                command,
                status: format!("could not start: {e}"),
            }),
        }
    }

    /// Records a step that cannot run here, and why; it is printed now and
    /// in the summary, never dropped silently.
    pub fn skip(&mut self, name: &str, why: &str) {
        println!("\n=== {name}: skipped: {why}");
        self.done.push(format!("{name}: skipped: {why}"));
    }

    /// Records a finding of the tier (what a backend ran on) for the summary.
    pub fn note(&mut self, line: String) {
        println!("{line}");
        self.done.push(line);
    }

    /// Prints every step's outcome and the tier's wall time.
    pub fn summary(&self) {
        println!(
            "\ncargo xtask {}: {}s",
            self.tier,
            self.start.elapsed().as_secs()
        );
        for line in &self.done {
            println!("  {line}");
        }
    }
}

/// The command as a shell line: its environment changes, program and
/// arguments.
fn render(cmd: &Command) -> String {
    let mut parts: Vec<String> = cmd
        .get_envs()
        .filter_map(|(k, v)| Some(format!("{}={}", k.to_str()?, v?.to_str()?)))
        .collect();
    parts.push(cmd.get_program().to_string_lossy().into_owned());
    parts.extend(cmd.get_args().map(|a| {
        let a = a.to_string_lossy();
        if a.contains([' ', '&', '|', ';', '\'']) {
            format!("'{a}'")
        } else {
            a.into_owned()
        }
    }));
    parts.join(" ")
}
