//! `config_enum!`: a string-valued configuration enum with its serde names, `as_str`, `Display`
//! and `FromStr` generated from one list, so the names can never disagree.

/// Defines a fieldless enum whose variants are written in TOML as the given strings.
///
/// Generates: the enum (with `Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize`
/// plus any derives passed in), `ALL`, `as_str()`, `Display` and `FromStr`.
macro_rules! config_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident ($what:literal) {
            $( $(#[$vmeta:meta])* $variant:ident = $s:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ::serde::Serialize, ::serde::Deserialize)]
        pub enum $name {
            $( $(#[$vmeta])* #[serde(rename = $s)] $variant ),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The name written in configuration files; stable, usable as a metric label.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $s),+
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::error::ValueParseError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|v| v.as_str() == s)
                    .ok_or_else(|| {
                        let names: Vec<&str> = Self::ALL.iter().map(|v| v.as_str()).collect();
                        $crate::error::ValueParseError::new(format!(
                            "unknown {} `{}`: expected one of {}",
                            $what,
                            s,
                            names.join(", ")
                        ))
                    })
            }
        }
    };
}
