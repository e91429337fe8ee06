//! A retire signal that records how it fired, for tests of when and where
//! stream-ordered frees settle.

use memgov::{RetireOutcome, RetireSignal};
use std::sync::mpsc::{channel, Receiver};
use std::thread::ThreadId;

/// A signal that sends its outcome and the thread it settled on to the
/// returned receiver.
pub fn signal() -> (RetireSignal, Receiver<(RetireOutcome, ThreadId)>) {
    let (tx, rx) = channel();
    (
        RetireSignal::from_fn(move |o| {
            let _ = tx.send((o, std::thread::current().id()));
        }),
        rx,
    )
}
