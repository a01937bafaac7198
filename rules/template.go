package rules

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
)

// segment is one "/"-separated piece of a template path. A segment holds
// at most one placeholder, optionally with a literal prefix and suffix, so
// "{job_id}:cancel" and "{model_id}:analyze" are single segments.
type segment struct {
	literal string // whole segment when Name == ""
	prefix  string
	name    string // placeholder name, "" for a literal segment
	suffix  string
}

// parseTemplate parses "METHOD /path/{placeholder}[?query]" or
// "METHOD {field}". It returns a description of the first problem.
func parseTemplate(s string) (Template, error) {
	s = strings.TrimSpace(s)
	method, rest, ok := strings.Cut(s, " ")
	rest = strings.TrimSpace(rest)
	if !ok || rest == "" {
		return Template{}, errors.New(`want "METHOD /path", e.g. "GET /v1/jobs/{job_id}"`)
	}
	if !isToken(method) || strings.ToUpper(method) != method {
		return Template{}, fmt.Errorf("method %q is not an upper-case HTTP method", method)
	}
	t := Template{Method: method}
	if strings.HasPrefix(rest, "{") && strings.HasSuffix(rest, "}") && strings.Count(rest, "{") == 1 && !strings.Contains(rest, "/") {
		name := rest[1 : len(rest)-1]
		if !validPlaceholder(name) {
			return Template{}, fmt.Errorf("placeholder %q is not a valid name", name)
		}
		t.Path = rest
		t.FieldURL = name
		return t, nil
	}
	if !strings.HasPrefix(rest, "/") {
		return Template{}, fmt.Errorf("path %q must start with / (or be a single {field} holding a URL)", rest)
	}
	if strings.ContainsAny(rest, " \t#") {
		return Template{}, fmt.Errorf("path %q contains a space or #", rest)
	}
	path, query, _ := strings.Cut(rest, "?")
	if strings.ContainsAny(query, "{}") {
		return Template{}, fmt.Errorf("query %q may not hold placeholders (the query is ignored when matching)", query)
	}
	if _, err := splitSegments(path); err != nil {
		return Template{}, err
	}
	t.Path = path
	t.Query = query
	return t, nil
}

// splitSegments parses a template path into segments.
func splitSegments(path string) ([]segment, error) {
	path = strings.TrimPrefix(path, "/")
	if path == "" {
		return nil, nil
	}
	var segs []segment
	for _, raw := range strings.Split(path, "/") {
		if raw == "" {
			return nil, errors.New("path has an empty segment (//)")
		}
		open := strings.Count(raw, "{")
		close := strings.Count(raw, "}")
		switch {
		case open == 0 && close == 0:
			segs = append(segs, segment{literal: raw})
			continue
		case open != 1 || close != 1:
			return nil, fmt.Errorf("segment %q must hold at most one {placeholder}", raw)
		}
		i, j := strings.Index(raw, "{"), strings.Index(raw, "}")
		if j < i {
			return nil, fmt.Errorf("segment %q has unbalanced braces", raw)
		}
		name := raw[i+1 : j]
		if !validPlaceholder(name) {
			return nil, fmt.Errorf("placeholder %q is not a valid name (letters, digits, _ . -)", name)
		}
		segs = append(segs, segment{prefix: raw[:i], name: name, suffix: raw[j+1:]})
	}
	return segs, nil
}

func validPlaceholder(name string) bool {
	if name == "" {
		return false
	}
	for _, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '.' || r == '-') {
			return false
		}
	}
	return true
}

// Placeholders returns the placeholder names of the template in order.
func (t Template) Placeholders() []string {
	if t.FieldURL != "" {
		return []string{t.FieldURL}
	}
	segs, _ := splitSegments(t.Path)
	var out []string
	for _, s := range segs {
		if s.name != "" {
			out = append(out, s.name)
		}
	}
	return out
}

// String returns the template as written in the contract.
func (t Template) String() string {
	if t.Method == "" {
		return ""
	}
	s := t.Method + " " + t.Path
	if t.Query != "" {
		s += "?" + t.Query
	}
	return s
}

// IsZero reports whether the template is unset.
func (t Template) IsZero() bool { return t.Method == "" && t.Path == "" }

// JobIDParam is the placeholder that holds the provider job id: "job_id"
// when the template has it, else its only placeholder, else "".
func (t Template) JobIDParam() string {
	names := t.Placeholders()
	for _, n := range names {
		if n == "job_id" {
			return n
		}
	}
	if len(names) == 1 {
		return names[0]
	}
	return ""
}

// Expand builds the absolute URL of the template. Path placeholders are
// filled from params (path-escaped) and joined to base (the provider's
// base_url with its path prefix); the template's fixed query, if any, is
// appended. A field template ("GET {result_url}") returns params[field],
// which must be an absolute http(s) URL. A missing parameter is an error.
func (t Template) Expand(params map[string]string, base *url.URL) (string, error) {
	if t.FieldURL != "" {
		v := params[t.FieldURL]
		u, err := url.Parse(v)
		if v == "" || err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return "", fmt.Errorf("failed to expand %q: field %s holds no absolute http(s) URL", t.String(), t.FieldURL)
		}
		return v, nil
	}
	if base == nil {
		return "", fmt.Errorf("failed to expand %q: no base URL", t.String())
	}
	segs, err := splitSegments(t.Path)
	if err != nil {
		return "", fmt.Errorf("failed to expand %q: %w", t.String(), err)
	}
	var b strings.Builder
	b.WriteString(base.Scheme + "://" + base.Host + strings.TrimSuffix(base.EscapedPath(), "/"))
	for _, s := range segs {
		b.WriteByte('/')
		if s.name == "" {
			b.WriteString(s.literal)
			continue
		}
		v, ok := params[s.name]
		if !ok || v == "" {
			return "", fmt.Errorf("failed to expand %q: no value for {%s}", t.String(), s.name)
		}
		b.WriteString(s.prefix + url.PathEscape(v) + s.suffix)
	}
	if len(segs) == 0 {
		b.WriteByte('/')
	}
	if t.Query != "" {
		b.WriteString("?" + t.Query)
	}
	return b.String(), nil
}

// matchSegments matches escaped path segments against template segments
// and returns the unescaped placeholder values.
func matchSegments(tmpl []segment, parts []string) (map[string]string, bool) {
	if len(tmpl) != len(parts) {
		return nil, false
	}
	params := map[string]string{}
	for i, s := range tmpl {
		p := parts[i]
		if s.name == "" {
			if p != s.literal {
				// Tolerate escaping differences in literal segments.
				if up, err := url.PathUnescape(p); err != nil || up != s.literal {
					return nil, false
				}
			}
			continue
		}
		if len(p) <= len(s.prefix)+len(s.suffix) || !strings.HasPrefix(p, s.prefix) || !strings.HasSuffix(p, s.suffix) {
			return nil, false
		}
		raw := p[len(s.prefix) : len(p)-len(s.suffix)]
		v, err := url.PathUnescape(raw)
		if err != nil || v == "" {
			return nil, false
		}
		params[s.name] = v
	}
	return params, true
}

// segmentsOverlap reports whether some path could match both templates.
func segmentsOverlap(a, b []segment) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		x, y := a[i], b[i]
		switch {
		case x.name == "" && y.name == "":
			if x.literal != y.literal {
				return false
			}
		case x.name == "":
			if !literalFits(x.literal, y) {
				return false
			}
		case y.name == "":
			if !literalFits(y.literal, x) {
				return false
			}
		default:
			if !(strings.HasPrefix(x.prefix, y.prefix) || strings.HasPrefix(y.prefix, x.prefix)) ||
				!(strings.HasSuffix(x.suffix, y.suffix) || strings.HasSuffix(y.suffix, x.suffix)) {
				return false
			}
		}
	}
	return true
}

func literalFits(lit string, s segment) bool {
	return len(lit) > len(s.prefix)+len(s.suffix) && strings.HasPrefix(lit, s.prefix) && strings.HasSuffix(lit, s.suffix)
}

func isToken(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if r > 126 || r <= 32 || strings.ContainsRune(`"(),/:;<=>?@[\]{}`, r) {
			return false
		}
	}
	return true
}
