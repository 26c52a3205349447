//! Conversions between `google.protobuf.Struct`/`Value` and `serde_json::Value`.
//!
//! Tools and configs speak JSON inside the services; the wire speaks `Struct`. These
//! conversions are the one place where the two meet.

use prost_types::{ListValue, Struct, Value, value::Kind};
use serde_json::{Map, Number};

/// Converts a protobuf `Value` into JSON. A number that is not finite (which JSON cannot
/// hold) becomes `null`, as the protobuf JSON mapping does.
pub fn value_to_json(value: &Value) -> serde_json::Value {
    match &value.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::NumberValue(n)) => number_to_json(*n),
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::ListValue(list)) => {
            serde_json::Value::Array(list.values.iter().map(value_to_json).collect())
        }
        Some(Kind::StructValue(s)) => serde_json::Value::Object(struct_to_map(s)),
    }
}

/// Converts a protobuf `Struct` into a JSON object.
pub fn struct_to_json(s: &Struct) -> serde_json::Value {
    serde_json::Value::Object(struct_to_map(s))
}

fn struct_to_map(s: &Struct) -> Map<String, serde_json::Value> {
    s.fields
        .iter()
        .map(|(k, v)| (k.clone(), value_to_json(v)))
        .collect()
}

/// Integral values come back as JSON integers, so that `{"n": 3}` survives a round trip
/// through `Struct` (which stores every number as a double) as `3`, not `3.0`; so do those
/// beyond 2^53 (an `int64` id), as the integer the double holds, while a 64-bit integer
/// holds it: `4e+18` or `9007199254740992.0` is refused by strict parsers of integers
/// (Go's `encoding/json` into an `int64`) and by APIs that take an id in a path.
fn number_to_json(n: f64) -> serde_json::Value {
    const I64_END: f64 = 9_223_372_036_854_775_808.0; // 2^63
    const U64_END: f64 = 18_446_744_073_709_551_616.0; // 2^64
    if n.fract() == 0.0 {
        // The guards make the casts exact: the value is integral and in range.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        if (-I64_END..I64_END).contains(&n) {
            return serde_json::Value::Number(Number::from(n as i64));
        } else if (0.0..U64_END).contains(&n) {
            return serde_json::Value::Number(Number::from(n as u64));
        }
    }
    Number::from_f64(n).map_or(serde_json::Value::Null, serde_json::Value::Number)
}

/// Converts JSON into a protobuf `Value`. Integers beyond 2^53 lose precision, as they
/// would in any JSON parser that uses doubles.
pub fn json_to_value(json: &serde_json::Value) -> Value {
    let kind = match json {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(items) => Kind::ListValue(ListValue {
            values: items.iter().map(json_to_value).collect(),
        }),
        serde_json::Value::Object(map) => Kind::StructValue(map_to_struct(map)),
    };
    Value { kind: Some(kind) }
}

/// Converts a JSON value into a protobuf `Struct`; `None` unless it is an object.
pub fn json_to_struct(json: &serde_json::Value) -> Option<Struct> {
    json.as_object().map(map_to_struct)
}

fn map_to_struct(map: &Map<String, serde_json::Value>) -> Struct {
    Struct {
        fields: map
            .iter()
            .map(|(k, v)| (k.clone(), json_to_value(v)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn round_trip_keeps_integers_and_nesting() {
        let original = json!({
            "n": 3, "x": 2.5, "neg": -7, "s": "hi", "b": true, "z": null,
            "list": [1, "two", {"three": 3}], "obj": {"inner": [false]}
        });
        let back = struct_to_json(&json_to_struct(&original).unwrap());
        assert_eq!(back, original);
    }

    /// Integers beyond 2^53 (ids of 64 bits) come back in integer syntax, as the integer
    /// the double holds; only those beyond 64 bits in float syntax.
    #[test]
    fn large_integers_keep_integer_syntax() {
        let back = |n: serde_json::Value| value_to_json(&json_to_value(&n)).to_string();
        assert_eq!(back(json!(9_007_199_254_740_993_u64)), "9007199254740992");
        assert_eq!(
            back(json!(4_000_000_000_000_000_000_u64)),
            "4000000000000000000"
        );
        assert_eq!(
            back(json!(-4_000_000_000_000_000_000_i64)),
            "-4000000000000000000"
        );
        assert_eq!(back(json!(1e16)), "10000000000000000");
        assert_eq!(back(json!(1e19)), "10000000000000000000");
        assert_eq!(back(json!(1e20)), "1e+20");
        assert_eq!(back(json!(-1e19)), "-1e+19");
        assert_eq!(back(json!(2.5)), "2.5");
    }

    #[test]
    fn non_objects_are_not_structs() {
        assert!(json_to_struct(&json!([1, 2])).is_none());
        assert!(json_to_struct(&json!("s")).is_none());
    }

    #[test]
    fn non_finite_numbers_become_null() {
        let v = Value {
            kind: Some(Kind::NumberValue(f64::INFINITY)),
        };
        assert_eq!(value_to_json(&v), serde_json::Value::Null);
    }
}
