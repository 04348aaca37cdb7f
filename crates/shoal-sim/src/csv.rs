//! The plain CSV that traces and cluster files are written in: a header row, then one record a line, fields
//! separated by commas, no quoting; blank lines and lines starting with `#` are skipped. Numbers are checked here
//! so that every error names its file, line and column.

use crate::error::{Result, SimError};

/// A CSV file's header and rows, each row with its line number (the header is line 1).
#[derive(Debug)]
pub(crate) struct Table<'a> {
    pub file: &'a str,
    pub header: Vec<&'a str>,
    pub rows: Vec<(usize, Vec<&'a str>)>,
}

impl<'a> Table<'a> {
    /// Splits `text`; `file` names it in errors.
    pub fn parse(file: &'a str, text: &'a str) -> Result<Table<'a>> {
        let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim_end_matches('\r')));
        let header = loop {
            match lines.next() {
                Some((_, l)) if l.trim().is_empty() => continue,
                Some((_, l)) => break l.split(',').map(str::trim).collect::<Vec<_>>(),
                None => return Err(SimError::Empty { what: file.to_owned() }),
            }
        };
        let mut rows = Vec::new();
        for (n, l) in lines {
            let t = l.trim();
            if t.is_empty() || t.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = l.split(',').map(str::trim).collect();
            if fields.len() != header.len() {
                return Err(SimError::Row {
                    file: file.to_owned(),
                    line: n,
                    column: "row".into(),
                    message: format!("{} fields where the header has {}", fields.len(), header.len()),
                });
            }
            if let Some(f) = fields.iter().find(|f| f.contains('"')) {
                return Err(SimError::Row {
                    file: file.to_owned(),
                    line: n,
                    column: "row".into(),
                    message: format!("quoted fields are not read: {f}"),
                });
            }
            rows.push((n, fields));
        }
        Ok(Table { file, header, rows })
    }

    /// Each named column's position; refuses columns outside `required` and `optional` (naming them), a column
    /// twice, and a missing required one.
    pub fn columns(&self, required: &[&str], optional: &[&str]) -> Result<Vec<Option<usize>>> {
        let known = |c: &str| required.contains(&c) || optional.contains(&c);
        let unknown: Vec<String> = self.header.iter().filter(|c| !known(c)).map(|c| (*c).to_owned()).collect();
        if !unknown.is_empty() {
            let mut expected = required.join(",");
            if !optional.is_empty() {
                expected.push_str(&format!(" and optionally {}", optional.join(",")));
            }
            return Err(SimError::UnknownColumns { file: self.file.to_owned(), columns: unknown, expected });
        }
        for (i, c) in self.header.iter().enumerate() {
            if self.header[..i].contains(c) {
                return Err(SimError::Format { file: self.file.to_owned(), why: format!("column {c} appears twice") });
            }
        }
        let missing: Vec<String> =
            required.iter().filter(|c| !self.header.contains(c)).map(|c| (*c).to_owned()).collect();
        if !missing.is_empty() {
            return Err(SimError::MissingColumns { file: self.file.to_owned(), columns: missing });
        }
        Ok(required.iter().chain(optional).map(|c| self.header.iter().position(|h| h == c)).collect())
    }
}

/// One row's fields by column, for typed reads that name the cell on failure.
#[derive(Debug)]
pub(crate) struct Row<'t, 'a> {
    pub file: &'a str,
    pub line: usize,
    pub fields: &'t [&'a str],
}

impl<'a> Row<'_, 'a> {
    pub fn error(&self, column: &str, message: impl Into<String>) -> SimError {
        SimError::Row {
            file: self.file.to_owned(),
            line: self.line,
            column: column.to_owned(),
            message: message.into(),
        }
    }

    /// The cell, `""` when the column is absent.
    pub fn text(&self, at: Option<usize>) -> &'a str {
        at.map(|i| self.fields[i]).unwrap_or("")
    }

    /// A whole number; `default` when the cell is empty or absent and a default is given.
    pub fn uint(&self, column: &str, at: Option<usize>, default: Option<u64>) -> Result<u64> {
        let t = self.text(at);
        match (t.is_empty(), default) {
            (true, Some(d)) => Ok(d),
            (true, None) => Err(self.error(column, "empty")),
            _ => t.parse::<u64>().map_err(|_| self.error(column, format!("not a whole number: '{t}'"))),
        }
    }

    /// A signed whole number.
    pub fn int(&self, column: &str, at: Option<usize>, default: i64) -> Result<i64> {
        let t = self.text(at);
        if t.is_empty() {
            return Ok(default);
        }
        t.parse::<i64>().map_err(|_| self.error(column, format!("not a whole number: '{t}'")))
    }

    /// A finite, non-negative decimal number times `scale`, rounded to a whole number.
    pub fn scaled(&self, column: &str, at: Option<usize>, scale: f64) -> Result<u64> {
        let t = self.text(at);
        if t.is_empty() {
            return Err(self.error(column, "empty"));
        }
        let v: f64 = t.parse().map_err(|_| self.error(column, format!("not a number: '{t}'")))?;
        if !v.is_finite() || v < 0.0 {
            return Err(self.error(column, format!("must be a finite number, 0 or more: '{t}'")));
        }
        let s = (v * scale).round();
        if s >= u64::MAX as f64 / 4.0 {
            return Err(self.error(column, format!("too large: '{t}'")));
        }
        Ok(s as u64)
    }
}
