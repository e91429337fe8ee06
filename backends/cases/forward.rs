// Included (`include!`) into a vendor's `raw` module, which defines `Code`
// (its driver's result type): declares, for each `name(args) => call;`, a
// `pub unsafe fn name(args) -> Code` that makes that one driver call.
macro_rules! forward {
    ($($name:ident($($arg:ident: $ty:ty),* $(,)?) => $call:expr;)*) => {$(
        /// The driver's call, unchanged.
        ///
        /// # Safety
        ///
        /// The driver's: live handles and buffers that outlive the work
        /// queued on them, or a violation a case plants on purpose.
        pub unsafe fn $name($($arg: $ty),*) -> Code {
            // SAFETY: the caller's.
            unsafe { $call }
        }
    )*};
}
