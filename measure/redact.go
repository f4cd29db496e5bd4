package measure

import (
	"net/url"
	"slices"
	"strings"
)

// Redacted replaces a secret-looking value in a recorded command line.
const Redacted = "REDACTED"

// secretWords mark a flag, URL query parameter or NAME=VALUE name as
// carrying a secret when one of its words (split at '-', '_' and '.',
// lower case) is one of them: "api-key", "access_token", "apiKey" do,
// "sp-output-tokens" does not.
var secretWords = []string{"key", "apikey", "token", "secret", "password", "passwd", "pwd", "credential", "credentials",
	"auth", "authorization", "bearer", "cookie", "signature", "sig"}

// notSecretSuffixes mark a secret-looking flag whose value only says where
// the secret is (an environment variable's name, a file).
var notSecretSuffixes = []string{"-env", "_env", "-file", "_file", "-path", "_path", "-dir", "_dir"}

// secretPrefixes start well-known credential formats: OpenAI and
// Anthropic-style keys, Hugging Face, GitHub, GitLab and Slack tokens, AWS
// access key ids.
var secretPrefixes = []string{"sk-", "sk_", "hf_", "ghp_", "gho_", "ghs_", "ghu_", "github_pat_", "glpat-", "xoxb-", "xoxp-", "xoxa-", "AKIA", "ASIA"}

// RedactArgs returns a copy of a command line with secret-looking values
// replaced by Redacted:
//
//   - the value of a flag whose name says it holds a secret (a word key,
//     token, secret, password, credential, auth, ...: --api-key X,
//     --token=X; not --sp-output-tokens), unless the name ends in -env,
//     -file, -path or -dir;
//   - the value of a NAME=VALUE argument whose name does;
//   - a value in a well-known credential format (sk-..., hf_..., ghp_...,
//     AKIA...) or carrying an HTTP credential ("Bearer ...", "Basic ...");
//   - a URL's password and its secret-looking query parameters.
//
// It errs toward redacting: a boolean flag with such a name takes the next
// argument with it. args[0], the program, is kept.
func RedactArgs(args []string) []string {
	out := make([]string, len(args))
	redactNext := false
	for i, a := range args {
		switch {
		case i == 0:
			out[i] = a
		case redactNext && !strings.HasPrefix(a, "-"):
			out[i] = Redacted
			redactNext = false
		default:
			redactNext = false
			out[i] = redactArg(a, &redactNext)
		}
	}
	return out
}

// redactArg redacts one argument; for a secret-named flag without a value
// it sets *next so that the following argument is redacted.
func redactArg(a string, next *bool) string {
	if strings.HasPrefix(a, "-") && a != "-" && a != "--" {
		name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if secretName(name) {
			if !hasVal {
				*next = true
				return a
			}
			return a[:len(a)-len(val)] + Redacted
		}
		if hasVal {
			return a[:len(a)-len(val)] + RedactValue(val)
		}
		return a
	}
	if name, _, ok := strings.Cut(a, "="); ok && !strings.ContainsAny(name, " /:") && secretName(name) {
		return name + "=" + Redacted
	}
	return RedactValue(a)
}

// secretName reports whether a flag, parameter or variable name says it
// holds a secret.
func secretName(name string) bool {
	n := strings.ToLower(name)
	for _, s := range notSecretSuffixes {
		if strings.HasSuffix(n, s) {
			return false
		}
	}
	for w := range strings.FieldsFuncSeq(n, func(r rune) bool { return r == '-' || r == '_' || r == '.' }) {
		if slices.Contains(secretWords, w) {
			return true
		}
	}
	return false
}

// RedactValue redacts a value that is itself a credential (see RedactArgs),
// or a URL carrying one.
func RedactValue(v string) string {
	for _, p := range secretPrefixes {
		if strings.HasPrefix(v, p) && len(v) > len(p)+8 {
			return Redacted
		}
	}
	lv := strings.ToLower(v)
	for _, scheme := range []string{"bearer ", "basic ", "token "} {
		if i := strings.Index(lv, scheme); i >= 0 {
			return v[:i+len(scheme)] + Redacted
		}
	}
	if strings.Contains(v, "://") {
		if u, err := url.Parse(v); err == nil && u.Host != "" {
			changed := false
			if u.User != nil {
				if _, ok := u.User.Password(); ok {
					u.User = url.UserPassword(u.User.Username(), Redacted)
				} else {
					u.User = url.User(Redacted)
				}
				changed = true
			}
			if q := u.Query(); len(q) > 0 {
				for k := range q {
					if secretName(k) {
						q.Set(k, Redacted)
						changed = true
					}
				}
				if changed {
					u.RawQuery = q.Encode()
				}
			}
			if changed {
				return u.String()
			}
		}
	}
	return v
}

// RedactText redacts every URL and credential-looking word of a message
// (RedactValue), such as an HTTP client's error naming the URL it failed
// on; words are separated by spaces and may be quoted.
func RedactText(msg string) string {
	words := strings.Split(msg, " ")
	changed := false
	for i, w := range words {
		core := strings.TrimRight(strings.TrimLeft(w, `"'(<`), `"'):,;>`)
		if core == "" {
			continue
		}
		if r := RedactValue(core); r != core {
			words[i] = strings.Replace(w, core, r, 1)
			changed = true
		}
	}
	if !changed {
		return msg
	}
	return strings.Join(words, " ")
}
