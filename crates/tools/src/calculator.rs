//! A small arithmetic evaluator: `+ - * / % ^`, parentheses, unary signs and decimals.
//!
//! Precedence, lowest first: `+ -`; `* / %`; unary `+ -`; `^` (right-associative, so
//! `2^3^2` is 512 and `-2^2` is -4, as in mathematics).

use std::fmt;

/// Longest expression accepted, in bytes.
pub(crate) const MAX_LEN: usize = 10_000;
/// Deepest nesting of parentheses and signs accepted; bounds the recursion.
const MAX_DEPTH: usize = 200;

/// Why an expression could not be evaluated.
#[derive(Debug, Clone, PartialEq)]
pub enum CalcError {
    /// The text is not an arithmetic expression; says where and why.
    Syntax(String),
    /// Division or remainder by zero.
    DivisionByZero,
    /// The result is too large, or undefined (e.g. `(-8)^0.5`).
    NotFinite,
}

impl fmt::Display for CalcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Syntax(msg) => write!(f, "malformed expression: {msg}"),
            Self::DivisionByZero => f.write_str("division by zero"),
            Self::NotFinite => f.write_str("the result is not a finite number"),
        }
    }
}

/// Evaluates `expression`.
pub fn evaluate(expression: &str) -> Result<f64, CalcError> {
    if expression.len() > MAX_LEN {
        return Err(CalcError::Syntax(format!(
            "expression longer than {MAX_LEN} bytes"
        )));
    }
    let mut parser = Parser {
        src: expression.as_bytes(),
        pos: 0,
        depth: 0,
    };
    parser.skip_ws();
    if parser.at_end() {
        return Err(CalcError::Syntax("empty expression".into()));
    }
    let value = parser.expr()?;
    parser.skip_ws();
    if !parser.at_end() {
        return Err(parser.unexpected());
    }
    if value.is_finite() {
        Ok(value)
    } else {
        Err(CalcError::NotFinite)
    }
}

struct Parser<'a> {
    src: &'a [u8],
    pos: usize,
    depth: usize,
}

impl Parser<'_> {
    fn at_end(&self) -> bool {
        self.pos >= self.src.len()
    }

    fn skip_ws(&mut self) {
        while self.src.get(self.pos).is_some_and(u8::is_ascii_whitespace) {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.src.get(self.pos).copied()
    }

    fn unexpected(&self) -> CalcError {
        match self.src.get(self.pos) {
            None => CalcError::Syntax("unexpected end of expression".into()),
            Some(_) => {
                // Report the character, not the byte, so that non-ASCII input reads well.
                let rest = String::from_utf8_lossy(&self.src[self.pos..]);
                let ch = rest.chars().next().unwrap_or('?');
                CalcError::Syntax(format!("unexpected {ch:?} at position {}", self.pos + 1))
            }
        }
    }

    fn enter(&mut self) -> Result<(), CalcError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(CalcError::Syntax(format!(
                "nested deeper than {MAX_DEPTH} levels"
            )));
        }
        Ok(())
    }

    /// expr := term (('+' | '-') term)*
    fn expr(&mut self) -> Result<f64, CalcError> {
        let mut value = self.term()?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.pos += 1;
            let rhs = self.term()?;
            value = if op == b'+' { value + rhs } else { value - rhs };
        }
        Ok(value)
    }

    /// term := unary (('*' | '/' | '%') unary)*
    fn term(&mut self) -> Result<f64, CalcError> {
        let mut value = self.unary()?;
        while let Some(op @ (b'*' | b'/' | b'%')) = self.peek() {
            self.pos += 1;
            let rhs = self.unary()?;
            value = match op {
                b'*' => value * rhs,
                _ if rhs == 0.0 => return Err(CalcError::DivisionByZero),
                b'/' => value / rhs,
                _ => value % rhs,
            };
        }
        Ok(value)
    }

    /// unary := ('+' | '-') unary | power
    fn unary(&mut self) -> Result<f64, CalcError> {
        match self.peek() {
            Some(sign @ (b'+' | b'-')) => {
                self.pos += 1;
                self.enter()?;
                let value = self.unary()?;
                self.depth -= 1;
                Ok(if sign == b'-' { -value } else { value })
            }
            _ => self.power(),
        }
    }

    /// power := primary ('^' unary)?
    fn power(&mut self) -> Result<f64, CalcError> {
        let base = self.primary()?;
        if self.peek() == Some(b'^') {
            self.pos += 1;
            self.enter()?;
            let exponent = self.unary()?;
            self.depth -= 1;
            return Ok(base.powf(exponent));
        }
        Ok(base)
    }

    /// primary := number | '(' expr ')'
    fn primary(&mut self) -> Result<f64, CalcError> {
        match self.peek() {
            Some(b'(') => {
                self.pos += 1;
                self.enter()?;
                let value = self.expr()?;
                self.depth -= 1;
                if self.peek() != Some(b')') {
                    return Err(match self.src.get(self.pos) {
                        None => CalcError::Syntax("missing closing parenthesis".into()),
                        Some(_) => self.unexpected(),
                    });
                }
                self.pos += 1;
                Ok(value)
            }
            Some(b'0'..=b'9' | b'.') => self.number(),
            _ => Err(self.unexpected()),
        }
    }

    /// number := digits ('.' digits?)? | '.' digits, with an optional exponent `e[+-]digits`
    fn number(&mut self) -> Result<f64, CalcError> {
        let start = self.pos;
        let digits = |p: &mut Self| {
            let from = p.pos;
            while p.src.get(p.pos).is_some_and(u8::is_ascii_digit) {
                p.pos += 1;
            }
            p.pos - from
        };
        let mut count = digits(self);
        if self.src.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            count += digits(self);
        }
        if count == 0 {
            self.pos = start;
            return Err(self.unexpected());
        }
        if matches!(self.src.get(self.pos), Some(b'e' | b'E')) {
            let mark = self.pos;
            self.pos += 1;
            if matches!(self.src.get(self.pos), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if digits(self) == 0 {
                self.pos = mark;
                return Err(self.unexpected());
            }
        }
        let text = std::str::from_utf8(&self.src[start..self.pos])
            .map_err(|_| CalcError::Syntax("invalid number".into()))?;
        text.parse::<f64>()
            .map_err(|_| CalcError::Syntax(format!("invalid number {text:?}")))
    }
}

/// Formats a result for people and models: integers without a fraction, others in the
/// shortest form that reads back to the same number.
pub fn format_number(value: f64) -> String {
    if value == 0.0 {
        return "0".into(); // also for -0
    }
    if value.fract() == 0.0 && value.abs() < 1e15 {
        return format!("{value:.0}");
    }
    value.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(s: &str) -> f64 {
        evaluate(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn precedence_and_associativity() {
        assert_eq!(eval("1 + 2 * 3"), 7.0);
        assert_eq!(eval("(1 + 2) * 3"), 9.0);
        assert_eq!(eval("10 - 4 - 3"), 3.0);
        assert_eq!(eval("100 / 10 / 5"), 2.0);
        assert_eq!(eval("2 ^ 3 ^ 2"), 512.0);
        assert_eq!(eval("-2 ^ 2"), -4.0);
        assert_eq!(eval("2 ^ -1"), 0.5);
        assert_eq!(eval("17 % 5 * 2"), 4.0);
        assert_eq!(eval("--3"), 3.0);
        assert_eq!(eval("-(2 + 3) * +4"), -20.0);
    }

    #[test]
    fn decimals_and_exponents() {
        assert_eq!(eval("0.1 + .2 + 3."), 0.1 + 0.2 + 3.0);
        assert_eq!(eval("1.5e3 / 3"), 500.0);
        assert_eq!(eval("7.5 % 2"), 1.5);
    }

    #[test]
    fn errors_say_what_is_wrong() {
        assert_eq!(evaluate("1 / 0"), Err(CalcError::DivisionByZero));
        assert_eq!(evaluate("5 % (2 - 2)"), Err(CalcError::DivisionByZero));
        assert_eq!(evaluate("10 ^ 400"), Err(CalcError::NotFinite));
        assert_eq!(evaluate("(-8) ^ 0.5"), Err(CalcError::NotFinite));
        for (input, needle) in [
            ("", "empty"),
            ("   ", "empty"),
            ("2 +", "end of expression"),
            ("(1 + 2", "missing closing parenthesis"),
            ("1 + 2)", "unexpected ')' at position 6"),
            ("2 x 3", "unexpected 'x' at position 3"),
            ("1..2", "unexpected '.'"),
            ("1e", "unexpected 'e'"),
            ("√4", "unexpected '√'"),
        ] {
            let err = evaluate(input).unwrap_err().to_string();
            assert!(err.contains(needle), "{input:?} gave {err:?}");
        }
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let deep = format!("{}1{}", "(".repeat(10_000), ")".repeat(10_000));
        assert!(matches!(evaluate(&deep), Err(CalcError::Syntax(_))));
        let signs = format!("{}1", "-".repeat(5_000));
        assert!(matches!(evaluate(&signs), Err(CalcError::Syntax(_))));
    }

    #[test]
    fn numbers_format_plainly() {
        assert_eq!(format_number(42.0), "42");
        assert_eq!(format_number(-0.0), "0");
        assert_eq!(format_number(0.5), "0.5");
        assert_eq!(format_number(1e20), "100000000000000000000");
        assert_eq!(format_number(1.0 / 3.0), "0.3333333333333333");
    }
}
