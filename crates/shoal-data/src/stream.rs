//! Streaming text from a file, for corpora too large to hold in memory.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::PathBuf;

use crate::dataset::{SampleIter, shard_stream};
use crate::{DatasetInfo, Error, IterableDataset, Kind, Result, Sample};

/// Byte-level windows streamed from a file: record `k` is bytes `k*context .. (k+1)*context + 1` (input = the first
/// `context` bytes, target = the next byte at each position). Records are dealt to ranks round-robin; a short tail
/// that cannot fill a window is dropped. The file is read sequentially and never held whole.
#[derive(Debug, Clone)]
pub struct TextFile {
    path: PathBuf,
    context: usize,
}

impl TextFile {
    pub fn new(path: impl Into<PathBuf>, context: usize) -> Result<Self> {
        if context == 0 {
            return Err(crate::error::invalid("context", "must be at least 1"));
        }
        Ok(TextFile { path: path.into(), context })
    }
}

struct Windows<R> {
    reader: R,
    what: String,
    context: usize,
    /// The last byte of the previous window (the first input byte of the next one).
    carry: Option<u8>,
    done: bool,
}

impl<R: Read> Iterator for Windows<R> {
    type Item = Result<Sample>;

    fn next(&mut self) -> Option<Result<Sample>> {
        if self.done {
            return None;
        }
        let mut buf = Vec::with_capacity(self.context + 1);
        buf.extend(self.carry);
        let need = self.context + 1 - buf.len();
        let mut chunk = vec![0u8; need];
        let mut filled = 0;
        while filled < need {
            match self.reader.read(&mut chunk[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => {
                    self.done = true;
                    return Some(Err(Error::Io { what: self.what.clone(), source }));
                }
            }
        }
        buf.extend_from_slice(&chunk[..filled]);
        if buf.len() < self.context + 1 {
            self.done = true;
            return None;
        }
        self.carry = buf.last().copied();
        let tokens: Vec<u32> = buf.iter().map(|&b| u32::from(b)).collect();
        Some(Ok(Sample::tokens(tokens[..self.context].to_vec(), tokens[1..].to_vec())))
    }
}

impl IterableDataset for TextFile {
    fn info(&self) -> DatasetInfo {
        let len =
            std::fs::metadata(&self.path).map(|m| (m.len() as usize).saturating_sub(1) / self.context).unwrap_or(0);
        DatasetInfo {
            name: self.path.display().to_string(),
            kind: Kind::Text,
            len,
            features: self.context,
            classes: 256,
            description: "byte-level windows streamed from a file".into(),
        }
    }

    fn stream(&self, world_size: usize, rank: usize) -> Result<SampleIter<'_>> {
        let what = self.path.display().to_string();
        let file = File::open(&self.path).map_err(|source| Error::Io { what: what.clone(), source })?;
        let windows = Windows { reader: BufReader::new(file), what, context: self.context, carry: None, done: false };
        shard_stream(windows, world_size, rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_windows_match_the_bytes_and_shard() {
        let path = std::env::temp_dir().join(format!("shoal-data-stream-{}.txt", std::process::id()));
        let text: Vec<u8> = (0..103u8).collect();
        std::fs::write(&path, &text).expect("write temp file");
        let t = TextFile::new(&path, 10).expect("valid");
        assert_eq!(t.info().len, 10);
        let all: Vec<Sample> = t.stream(1, 0).expect("opens").map(|s| s.expect("reads")).collect();
        assert_eq!(all.len(), 10);
        for (k, s) in all.iter().enumerate() {
            let want: Vec<u32> = (k * 10..k * 10 + 11).map(|b| b as u32).collect();
            assert_eq!(s, &Sample::tokens(want[..10].to_vec(), want[1..].to_vec()));
        }
        let odd: Vec<Sample> = t.stream(2, 1).expect("opens").map(|s| s.expect("reads")).collect();
        assert_eq!(odd, all.iter().skip(1).step_by(2).cloned().collect::<Vec<_>>());
        std::fs::remove_file(&path).expect("cleanup");
        let err = TextFile::new(&path, 10).expect("valid").stream(1, 0).err().expect("missing file");
        assert!(err.to_string().contains("shoal-data-stream"), "{err}");
        assert!(TextFile::new(&path, 0).is_err());
    }
}
