//! Names in a run's checkpoint tree: the subdirectory, the files of a step directory, and the names of step
//! directories (`step-NNNNNN`) and of saves in progress (`step-NNNNNN.tmp-<pid>`).

/// Subdirectory of the run's output directory that holds the checkpoints.
pub const CHECKPOINTS_SUBDIR: &str = "checkpoints";
/// File holding the model parameters.
pub const MODEL_FILE: &str = "model.safetensors";
/// File holding the optimizer state.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The manifest, written last.
pub const MANIFEST_FILE: &str = "manifest.json";

/// `step-NNNNNN`, the directory name of `step`.
pub(super) fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// `step-<digits>` -> the step.
pub(crate) fn parse_step_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// `step-<digits>.tmp-<pid>[...]` -> the pid (None for any other name).
pub(super) fn parse_temp_name(name: &str) -> Option<Option<u32>> {
    let rest = name.strip_prefix("step-")?;
    let (digits, after) = rest.split_once(".tmp-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let pid: String = after.chars().take_while(char::is_ascii_digit).collect();
    Some(pid.parse().ok())
}
