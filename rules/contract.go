package rules

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// Built-in defaults, used where providers.yaml is silent (documented on
// Policy and in the README).
var builtinPolicy = Policy{
	Deadline:             40 * time.Minute,
	MaxStatusRequests:    12,
	MaxTransportFailures: 3,
	MaxRateLimited:       3,
	Backoff:              Backoff{Base: 5 * time.Second, Max: 120 * time.Second, JitterFloor: 0.5},
	NotFoundGrace:        30 * time.Second,
	Lease:                30 * time.Second,
	Extension:            ExtensionPolicy{Duration: 15 * time.Minute, StatusRequests: 4, MaxExtensions: 2},
	EarlyPoll:            "reject",
}

// DefaultPolicy returns the built-in policy used where the contract is silent.
func DefaultPolicy() Policy { return builtinPolicy }

// DefaultAccountHeader is used when a provider sets no account_header.
const DefaultAccountHeader = "Authorization"

// Problem is one thing wrong with a contract file.
type Problem struct {
	File     string
	Line     int
	Provider string // provider name, "" for file-level problems
	Field    string // dotted key path, e.g. "status.states"
	Msg      string
	Hint     string // how to fix it, may be ""
}

func (p Problem) String() string {
	var b strings.Builder
	b.WriteString(p.File)
	if p.Line > 0 {
		fmt.Fprintf(&b, ":%d", p.Line)
	}
	b.WriteString(": ")
	if p.Provider != "" {
		fmt.Fprintf(&b, "provider %q: ", p.Provider)
	}
	if p.Field != "" {
		b.WriteString(p.Field + ": ")
	}
	b.WriteString(p.Msg)
	if p.Hint != "" {
		b.WriteString(" (hint: " + p.Hint + ")")
	}
	return b.String()
}

// ValidationError lists every problem found in a contract, ordered by line.
type ValidationError struct {
	Problems []Problem
}

// Error returns one line per problem.
func (e *ValidationError) Error() string {
	lines := make([]string, len(e.Problems))
	for i, p := range e.Problems {
		lines[i] = p.String()
	}
	return strings.Join(lines, "\n")
}

// Load reads and parses a contract file. It is the only function in rules
// that touches the disk.
func Load(path string) (*Contract, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("failed to read contract: %w (hint: pass --config or set POLLGATE_CONFIG)", err)
	}
	c, err := Parse(filepath.Base(path), data)
	if err != nil {
		return nil, err
	}
	c.Path = path
	return c, nil
}

// Parse parses and validates contract bytes. name is used in messages
// (e.g. "providers.yaml"). Unknown keys are rejected; every problem is
// reported at once in a *ValidationError.
func Parse(name string, data []byte) (*Contract, error) {
	l := &loader{file: name}
	c := l.parse(data)
	if len(l.problems) > 0 {
		sort.SliceStable(l.problems, func(i, j int) bool { return l.problems[i].Line < l.problems[j].Line })
		return nil, &ValidationError{Problems: l.problems}
	}
	sum := sha256.Sum256(data)
	c.Hash = hex.EncodeToString(sum[:])[:12]
	c.Path = name
	return c, nil
}

// ---------------------------------------------------------------------------
// loader: walks the YAML node tree, so every problem has a line.
// ---------------------------------------------------------------------------

type loader struct {
	file     string
	problems []Problem
}

func (l *loader) add(line int, provider, field, msg, hint string) {
	l.problems = append(l.problems, Problem{File: l.file, Line: line, Provider: provider, Field: field, Msg: msg, Hint: hint})
}

var yamlLineRE = regexp.MustCompile(`line (\d+)`)

func (l *loader) parse(data []byte) *Contract {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		line := 0
		if m := yamlLineRE.FindStringSubmatch(err.Error()); m != nil {
			line, _ = strconv.Atoi(m[1])
		}
		l.add(line, "", "", "not valid YAML: "+strings.TrimPrefix(err.Error(), "yaml: "), "check indentation and quoting")
		return nil
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) == 0 {
		l.add(1, "", "", "the contract is empty", "start with `version: 1` and a providers list")
		return nil
	}
	root := doc.Content[0]
	top := l.mapping(root, "", "", "version", "defaults", "providers")
	if top == nil {
		return nil
	}
	c := &Contract{}
	if v, ok := top["version"]; !ok {
		l.add(root.Line, "", "version", "missing", "add `version: 1` at the top")
	} else if n, ok := l.int(v, "", "version"); ok && n != 1 {
		l.add(v.Line, "", "version", fmt.Sprintf("unsupported schema version %d", n), "this pollgate reads version: 1")
	} else {
		c.Version = n
	}

	defaults := builtinPolicy
	var defPatch policyPatch
	if d, ok := top["defaults"]; ok {
		dm := l.mapping(d, "", "defaults", "policy", "notify")
		if pn, ok := dm["policy"]; ok {
			defPatch = l.policy(pn, "", "defaults.policy")
			defPatch.apply(&defaults)
			l.checkPolicy(defaults, defPatch, "", "defaults.policy")
		}
		if nn, ok := dm["notify"]; ok {
			c.Notify = l.notify(nn, "", "defaults.notify")
		}
	}
	c.Defaults = defaults

	pn, ok := top["providers"]
	if !ok {
		l.add(root.Line, "", "providers", "missing", "list at least one provider under `providers:`")
		return c
	}
	if pn.Kind != yaml.SequenceNode {
		l.add(pn.Line, "", "providers", "must be a list", "write each provider as `- name: ...`")
		return c
	}
	if len(pn.Content) == 0 {
		l.add(pn.Line, "", "providers", "the list is empty", "add at least one provider")
	}
	seen := map[string]int{}
	for _, item := range pn.Content {
		p := l.provider(item, defaults, defPatch)
		if p == nil {
			continue
		}
		if first, dup := seen[p.Name]; dup && p.Name != "" {
			l.add(p.Line, p.Name, "name", "duplicate provider name", fmt.Sprintf("the first %q is on line %d; names must be unique", p.Name, first))
		} else {
			seen[p.Name] = p.Line
		}
		c.Providers = append(c.Providers, p)
	}
	l.checkOverlaps(c.Providers)
	for _, p := range c.Providers {
		p.compiled = compileTemplates(p)
	}
	return c
}

// mapping checks that n is a mapping with only the allowed keys and returns
// the values by key. Unknown and duplicate keys are problems.
func (l *loader) mapping(n *yaml.Node, provider, field string, allowed ...string) map[string]*yaml.Node {
	if n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	if n.Kind != yaml.MappingNode {
		where := field
		if where == "" {
			where = "the document"
		}
		l.add(n.Line, provider, field, "must be a mapping of keys", "write `key: value` pairs under "+where)
		return nil
	}
	out := map[string]*yaml.Node{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		key := k.Value
		if key == "<<" {
			l.add(k.Line, provider, join(field, key), "YAML merge keys are not supported", "share settings through defaults.policy instead")
			continue
		}
		if !contains(allowed, key) {
			hint := "allowed keys: " + strings.Join(allowed, ", ")
			if s := closest(key, allowed); s != "" {
				hint = "did you mean " + s + "? " + hint
			}
			l.add(k.Line, provider, join(field, key), "unknown key", hint)
			continue
		}
		if _, dup := out[key]; dup {
			l.add(k.Line, provider, join(field, key), "duplicate key", "keep one of them")
			continue
		}
		if v.Kind == yaml.AliasNode && v.Alias != nil {
			v = v.Alias
		}
		out[key] = v
	}
	return out
}

func (l *loader) str(n *yaml.Node, provider, field string) (string, bool) {
	if n.Kind != yaml.ScalarNode {
		l.add(n.Line, provider, field, "must be a single value", "")
		return "", false
	}
	if n.Tag == "!!null" {
		l.add(n.Line, provider, field, "is empty", "give it a value or remove the key")
		return "", false
	}
	if n.Tag == "!!bool" {
		return strings.ToLower(n.Value), true
	}
	return n.Value, true
}

func (l *loader) int(n *yaml.Node, provider, field string) (int, bool) {
	if n.Kind != yaml.ScalarNode || n.Tag != "!!int" {
		l.add(n.Line, provider, field, fmt.Sprintf("%q is not a whole number", n.Value), "write a number such as 12")
		return 0, false
	}
	v, err := strconv.Atoi(n.Value)
	if err != nil {
		l.add(n.Line, provider, field, fmt.Sprintf("%q is not a whole number", n.Value), "write a number such as 12")
		return 0, false
	}
	return v, true
}

func (l *loader) bool(n *yaml.Node, provider, field string) (bool, bool) {
	if n.Kind != yaml.ScalarNode || n.Tag != "!!bool" {
		l.add(n.Line, provider, field, fmt.Sprintf("%q is not a boolean", n.Value), "write true or false")
		return false, false
	}
	return strings.EqualFold(n.Value, "true"), true
}

func (l *loader) duration(n *yaml.Node, provider, field string) (time.Duration, bool) {
	if n.Kind != yaml.ScalarNode {
		l.add(n.Line, provider, field, "must be a duration", "write e.g. 40m, 90s or 500ms")
		return 0, false
	}
	if n.Tag == "!!int" || n.Tag == "!!float" {
		l.add(n.Line, provider, field, fmt.Sprintf("%q has no unit", n.Value), "write e.g. "+n.Value+"s")
		return 0, false
	}
	d, err := time.ParseDuration(n.Value)
	if err != nil {
		l.add(n.Line, provider, field, fmt.Sprintf("%q is not a duration", n.Value), "write e.g. 40m, 90s or 500ms")
		return 0, false
	}
	if d <= 0 {
		l.add(n.Line, provider, field, fmt.Sprintf("%q is not positive", n.Value), "durations must be greater than zero")
		return 0, false
	}
	if d%time.Millisecond != 0 {
		l.add(n.Line, provider, field, fmt.Sprintf("%q is finer than a millisecond", n.Value), "round to whole milliseconds")
		return 0, false
	}
	return d, true
}

func (l *loader) strList(n *yaml.Node, provider, field string) []string {
	if n.Kind == yaml.ScalarNode && n.Tag != "!!null" {
		s, _ := l.str(n, provider, field)
		return []string{s}
	}
	if n.Kind != yaml.SequenceNode {
		if n.Tag != "!!null" {
			l.add(n.Line, provider, field, "must be a list", "write [a, b]")
		}
		return nil
	}
	var out []string
	for _, it := range n.Content {
		if s, ok := l.str(it, provider, field); ok {
			out = append(out, s)
		}
	}
	return out
}

// policyPatch is one policy block as written: nil fields were not set.
type policyPatch struct {
	line, backoffLine, extensionLine int

	deadline, businessDeadline, notFoundGrace, lease *time.Duration
	maxStatus, maxTransport, maxRate                 *int
	base, max                                        *time.Duration
	jitter                                           *float64
	extDuration                                      *time.Duration
	extRequests, extMax                              *int
	earlyPoll                                        *string
}

func (pp policyPatch) apply(p *Policy) {
	setD := func(dst *time.Duration, v *time.Duration) {
		if v != nil {
			*dst = *v
		}
	}
	setI := func(dst *int, v *int) {
		if v != nil {
			*dst = *v
		}
	}
	setD(&p.Deadline, pp.deadline)
	setD(&p.BusinessDeadline, pp.businessDeadline)
	setD(&p.NotFoundGrace, pp.notFoundGrace)
	setD(&p.Lease, pp.lease)
	setI(&p.MaxStatusRequests, pp.maxStatus)
	setI(&p.MaxTransportFailures, pp.maxTransport)
	setI(&p.MaxRateLimited, pp.maxRate)
	setD(&p.Backoff.Base, pp.base)
	setD(&p.Backoff.Max, pp.max)
	if pp.jitter != nil {
		p.Backoff.JitterFloor = *pp.jitter
	}
	setD(&p.Extension.Duration, pp.extDuration)
	setI(&p.Extension.StatusRequests, pp.extRequests)
	setI(&p.Extension.MaxExtensions, pp.extMax)
	if pp.earlyPoll != nil {
		p.EarlyPoll = *pp.earlyPoll
	}
}

func (l *loader) policy(n *yaml.Node, provider, field string) policyPatch {
	pp := policyPatch{line: n.Line}
	m := l.mapping(n, provider, field, "deadline", "business_deadline", "max_status_requests", "max_transport_failures",
		"max_rate_limited", "backoff", "not_found_grace", "lease", "extension", "early_poll")
	dur := func(key string, dst **time.Duration) {
		if v, ok := m[key]; ok {
			if d, ok := l.duration(v, provider, join(field, key)); ok {
				*dst = &d
			}
		}
	}
	budget := func(key string, dst **int, min int) {
		if v, ok := m[key]; ok {
			if i, ok := l.int(v, provider, join(field, key)); ok {
				if i < min {
					l.add(v.Line, provider, join(field, key), fmt.Sprintf("%d is below %d", i, min), fmt.Sprintf("budgets must be at least %d", min))
					return
				}
				*dst = &i
			}
		}
	}
	dur("deadline", &pp.deadline)
	dur("business_deadline", &pp.businessDeadline)
	dur("not_found_grace", &pp.notFoundGrace)
	dur("lease", &pp.lease)
	budget("max_status_requests", &pp.maxStatus, 1)
	budget("max_transport_failures", &pp.maxTransport, 1)
	budget("max_rate_limited", &pp.maxRate, 1)
	if v, ok := m["early_poll"]; ok {
		if s, ok := l.str(v, provider, join(field, "early_poll")); ok {
			if s != "reject" {
				l.add(v.Line, provider, join(field, "early_poll"), fmt.Sprintf("unknown mode %q", s), "the only mode is reject (429 + Retry-After)")
			} else {
				pp.earlyPoll = &s
			}
		}
	}
	if bn, ok := m["backoff"]; ok {
		pp.backoffLine = bn.Line
		bf := join(field, "backoff")
		bm := l.mapping(bn, provider, bf, "base", "max", "jitter_floor")
		if v, ok := bm["base"]; ok {
			if d, ok := l.duration(v, provider, bf+".base"); ok {
				pp.base = &d
			}
		}
		if v, ok := bm["max"]; ok {
			if d, ok := l.duration(v, provider, bf+".max"); ok {
				pp.max = &d
			}
		}
		if v, ok := bm["jitter_floor"]; ok {
			f, err := strconv.ParseFloat(v.Value, 64)
			switch {
			case v.Kind != yaml.ScalarNode || (v.Tag != "!!float" && v.Tag != "!!int") || err != nil:
				l.add(v.Line, provider, bf+".jitter_floor", fmt.Sprintf("%q is not a number", v.Value), "write a fraction such as 0.5")
			case !(f > 0 && f <= 1) || math.IsNaN(f):
				l.add(v.Line, provider, bf+".jitter_floor", fmt.Sprintf("%v is outside (0,1]", v.Value), "the floor is the fraction of the raw delay always waited, e.g. 0.5")
			default:
				pp.jitter = &f
			}
		}
	}
	if en, ok := m["extension"]; ok {
		pp.extensionLine = en.Line
		ef := join(field, "extension")
		em := l.mapping(en, provider, ef, "duration", "status_requests", "max_extensions")
		if v, ok := em["duration"]; ok {
			if d, ok := l.duration(v, provider, ef+".duration"); ok {
				pp.extDuration = &d
			}
		}
		if v, ok := em["status_requests"]; ok {
			if i, ok := l.int(v, provider, ef+".status_requests"); ok {
				if i < 1 {
					l.add(v.Line, provider, ef+".status_requests", fmt.Sprintf("%d is below 1", i), "an extension adds at least one status request")
				} else {
					pp.extRequests = &i
				}
			}
		}
		if v, ok := em["max_extensions"]; ok {
			if i, ok := l.int(v, provider, ef+".max_extensions"); ok {
				if i < 0 {
					l.add(v.Line, provider, ef+".max_extensions", fmt.Sprintf("%d is negative", i), "use 0 to never offer an extension")
				} else {
					pp.extMax = &i
				}
			}
		}
	}
	return pp
}

// checkPolicy checks cross-field rules of a merged policy. Problems are
// reported only where this block changed the fields involved, so an
// inherited mistake is reported once, at defaults.
func (l *loader) checkPolicy(p Policy, pp policyPatch, provider, field string) {
	if (pp.base != nil || pp.max != nil) && p.Backoff.Base > p.Backoff.Max {
		l.add(pp.backoffLine, provider, field+".backoff", fmt.Sprintf("base %s is greater than max %s", p.Backoff.Base, p.Backoff.Max), "raise max or lower base")
	}
	if (pp.businessDeadline != nil || pp.deadline != nil) && p.BusinessDeadline > p.Deadline {
		l.add(pp.line, provider, field+".business_deadline", fmt.Sprintf("%s is longer than the deadline %s", p.BusinessDeadline, p.Deadline), "a business deadline only makes sense when it is shorter (R19)")
	}
}

func (l *loader) notify(n *yaml.Node, provider, field string) *NotifySpec {
	m := l.mapping(n, provider, field, "webhook")
	v, ok := m["webhook"]
	if !ok {
		if m != nil {
			l.add(n.Line, provider, field+".webhook", "missing", "give the URL that receives escalations")
		}
		return nil
	}
	s, ok := l.str(v, provider, field+".webhook")
	if !ok {
		return nil
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		l.add(v.Line, provider, field+".webhook", fmt.Sprintf("%q is not an absolute http(s) URL", s), "write e.g. https://hooks.example.com/pollgate")
		return nil
	}
	return &NotifySpec{Webhook: s}
}

var providerNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)

func (l *loader) provider(n *yaml.Node, defaults Policy, defPatch policyPatch) *Provider {
	p := &Provider{Line: n.Line, Policy: defaults, AccountHeader: DefaultAccountHeader}
	// Read the name first so every later problem names the provider.
	if n.Kind == yaml.MappingNode {
		for i := 0; i+1 < len(n.Content); i += 2 {
			if n.Content[i].Value == "name" && n.Content[i+1].Kind == yaml.ScalarNode {
				p.Name = n.Content[i+1].Value
			}
		}
	}
	name := p.Name
	m := l.mapping(n, name, "", "name", "base_url", "account_header", "submit", "status", "result", "cancel", "escalation", "policy", "notify")
	if m == nil {
		return nil
	}
	if v, ok := m["name"]; !ok {
		l.add(n.Line, "", "name", "provider has no name", "add `name: my-provider`")
	} else if !providerNameRE.MatchString(p.Name) {
		l.add(v.Line, name, "name", "must be lower-case letters, digits, . _ -", "it appears in metrics and URLs, e.g. openai-batch")
	}

	if v, ok := m["base_url"]; !ok {
		l.add(n.Line, name, "base_url", "missing", "write scheme://host[:port][/path prefix], e.g. https://api.openai.com")
	} else if s, ok := l.str(v, name, "base_url"); ok {
		u, err := url.Parse(s)
		switch {
		case err != nil:
			l.add(v.Line, name, "base_url", fmt.Sprintf("%q is not a URL: %v", s, err), "write scheme://host[:port][/path prefix]")
		case u.Scheme != "https" && u.Scheme != "http":
			l.add(v.Line, name, "base_url", fmt.Sprintf("%q has no http or https scheme", s), "write e.g. https://api.example.com")
		case u.Host == "" || u.Hostname() == "":
			l.add(v.Line, name, "base_url", fmt.Sprintf("%q has no host", s), "write e.g. https://api.example.com")
		case u.User != nil || u.RawQuery != "" || u.Fragment != "" || strings.Contains(s, "{"):
			l.add(v.Line, name, "base_url", fmt.Sprintf("%q may hold only scheme, host, port and a path prefix", s), "move credentials, queries and placeholders out of base_url")
		default:
			if port := u.Port(); port != "" {
				if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
					l.add(v.Line, name, "base_url", fmt.Sprintf("%q has an invalid port", s), "ports are 1-65535")
					break
				}
			}
			u.Path = strings.TrimSuffix(u.Path, "/")
			u.RawPath = ""
			u.Host = strings.ToLower(u.Host)
			p.BaseURL = u
		}
	}
	if v, ok := m["account_header"]; ok {
		if s, ok := l.str(v, name, "account_header"); ok {
			if !isToken(s) {
				l.add(v.Line, name, "account_header", fmt.Sprintf("%q is not a header name", s), "write e.g. Authorization or x-api-key")
			} else {
				p.AccountHeader = s
			}
		}
	}

	// status first: the other templates refer to its placeholders.
	if v, ok := m["status"]; !ok {
		l.add(n.Line, name, "status", "missing", "every provider needs status.request, status.state and status.states")
	} else {
		l.status(v, p)
	}
	if v, ok := m["submit"]; ok {
		l.submit(v, p)
	}
	if v, ok := m["result"]; ok {
		p.Result = l.action(v, p, "result")
	}
	if v, ok := m["cancel"]; ok {
		p.Cancel = l.action(v, p, "cancel")
	}
	p.Escalation = EscalationSpec{StatusCode: 200}
	if v, ok := m["escalation"]; ok {
		em := l.mapping(v, name, "escalation", "status_code", "state_value")
		if sv, ok := em["status_code"]; ok {
			if code, ok := l.int(sv, name, "escalation.status_code"); ok {
				if code < 200 || code > 599 {
					l.add(sv.Line, name, "escalation.status_code", fmt.Sprintf("%d is not an HTTP status between 200 and 599", code), "200 lets legacy loops read the body; 409 or 424 mark the stop")
				} else {
					p.Escalation.StatusCode = code
				}
			}
		}
		if sv, ok := em["state_value"]; ok {
			if s, ok := l.str(sv, name, "escalation.state_value"); ok {
				p.Escalation.StateValue = s
			}
		}
	}
	if p.Escalation.StateValue == "" {
		p.Escalation.StateValue = "failed"
		if len(p.Status.States.Failure) > 0 {
			p.Escalation.StateValue = p.Status.States.Failure[0]
		}
	}
	if v, ok := m["policy"]; ok {
		pp := l.policy(v, name, "policy")
		pp.apply(&p.Policy)
		l.checkPolicy(p.Policy, pp, name, "policy")
	}
	if v, ok := m["notify"]; ok {
		p.Notify = l.notify(v, name, "notify")
	}
	return p
}

func (l *loader) template(n *yaml.Node, provider, field string) (Template, bool) {
	s, ok := l.str(n, provider, field)
	if !ok {
		return Template{}, false
	}
	t, err := parseTemplate(s)
	if err != nil {
		l.add(n.Line, provider, field, fmt.Sprintf("%q: %v", s, err), `write "METHOD /path/{job_id}"`)
		return Template{}, false
	}
	return t, true
}

func (l *loader) gjsonPath(n *yaml.Node, provider, field string) (string, bool) {
	s, ok := l.str(n, provider, field)
	if !ok {
		return "", false
	}
	if err := validGJSONPath(s); err != nil {
		l.add(n.Line, provider, field, fmt.Sprintf("%q is not a valid gjson path: %v", s, err), "use dotted keys such as status or data.result_url; escape literal dots as \\.")
		return "", false
	}
	return s, true
}

func (l *loader) status(n *yaml.Node, p *Provider) {
	name := p.Name
	m := l.mapping(n, name, "status", "request", "state", "state_default", "states", "success_requires", "success_forbids", "hints", "error", "request_id_header")
	if m == nil {
		return
	}
	st := &p.Status
	if v, ok := m["request"]; !ok {
		l.add(n.Line, name, "status.request", "missing", `write e.g. "GET /v1/jobs/{job_id}"`)
	} else if t, ok := l.template(v, name, "status.request"); ok {
		switch {
		case t.FieldURL != "":
			l.add(v.Line, name, "status.request", "must be a path template", "status calls are matched by path; write e.g. GET /v1/jobs/{job_id}")
		case t.Method != "GET" && t.Method != "HEAD":
			l.add(v.Line, name, "status.request", fmt.Sprintf("method %s is not safe", t.Method), "status calls must be GET (R12); model other calls as submit, result or cancel")
		case t.JobIDParam() == "":
			if len(t.Placeholders()) == 0 {
				l.add(v.Line, name, "status.request", "has no placeholder for the job id", "write e.g. GET /v1/jobs/{job_id}")
			} else {
				l.add(v.Line, name, "status.request", "has several placeholders and none is {job_id}", "name the placeholder that holds the job id {job_id}")
			}
		default:
			st.Request = t
		}
	}
	if v, ok := m["state"]; !ok {
		l.add(n.Line, name, "status.state", "missing", "give the gjson path of the job state, e.g. status")
	} else if s, ok := l.gjsonPath(v, name, "status.state"); ok {
		st.State = s
	}
	if v, ok := m["state_default"]; ok {
		if s, ok := l.str(v, name, "status.state_default"); ok {
			st.StateDefault = s
		}
	}
	if v, ok := m["states"]; !ok {
		l.add(n.Line, name, "status.states", "missing", "list the waiting, success, failure, cancelled and expired states (R2)")
	} else {
		sm := l.mapping(v, name, "status.states", "waiting", "success", "failure", "cancelled", "expired")
		cats := []struct {
			name string
			dst  *[]string
		}{{"waiting", &st.States.Waiting}, {"success", &st.States.Success}, {"failure", &st.States.Failure}, {"cancelled", &st.States.Cancelled}, {"expired", &st.States.Expired}}
		owner := map[string]string{}
		written := map[string]bool{} // categories with entries, even rejected ones
		for _, c := range cats {
			cn, ok := sm[c.name]
			if !ok {
				continue
			}
			for _, s := range l.strList(cn, name, "status.states."+c.name) {
				written[c.name] = true
				if prev, dup := owner[s]; dup {
					if prev == c.name {
						l.add(cn.Line, name, "status.states", fmt.Sprintf("%q is listed twice in %s", s, c.name), "list each state once")
					} else {
						l.add(cn.Line, name, "status.states", fmt.Sprintf("%q is both %s and %s", s, prev, c.name), "a state belongs to one category")
					}
					continue
				}
				if s == "" {
					l.add(cn.Line, name, "status.states."+c.name, "empty state name", "remove the empty entry")
					continue
				}
				owner[s] = c.name
				*c.dst = append(*c.dst, s)
			}
		}
		if sm != nil && !written["waiting"] {
			l.add(v.Line, name, "status.states.waiting", "no waiting state", "list the states in which the job is still running, e.g. [queued, running]")
		}
		if sm != nil && !written["success"] {
			l.add(v.Line, name, "status.states.success", "no success state", "list the states in which the result is ready, e.g. [succeeded]")
		}
		if st.StateDefault != "" && sm != nil {
			if _, ok := owner[st.StateDefault]; !ok {
				l.add(m["state_default"].Line, name, "status.state_default", fmt.Sprintf("%q is not in the state table", st.StateDefault), "use one of the listed states, usually a waiting one")
			}
		}
	}
	paths := func(key string) []string {
		v, ok := m[key]
		if !ok {
			return nil
		}
		var out []string
		for _, s := range l.strList(v, name, "status."+key) {
			if err := validGJSONPath(s); err != nil {
				l.add(v.Line, name, "status."+key, fmt.Sprintf("%q is not a valid gjson path: %v", s, err), "use dotted keys such as data.result_url")
				continue
			}
			out = append(out, s)
		}
		return out
	}
	st.SuccessRequires = paths("success_requires")
	st.SuccessForbids = paths("success_forbids")
	if v, ok := m["hints"]; ok {
		hm := l.mapping(v, name, "status.hints", "poll_after_seconds", "next_check_at", "expires_at")
		if hv, ok := hm["poll_after_seconds"]; ok {
			st.Hints.PollAfterSeconds, _ = l.gjsonPath(hv, name, "status.hints.poll_after_seconds")
		}
		if hv, ok := hm["next_check_at"]; ok {
			st.Hints.NextCheckAt, _ = l.gjsonPath(hv, name, "status.hints.next_check_at")
		}
		if hv, ok := hm["expires_at"]; ok {
			st.Hints.ExpiresAt, _ = l.gjsonPath(hv, name, "status.hints.expires_at")
		}
	}
	if v, ok := m["error"]; ok {
		st.Error, _ = l.gjsonPath(v, name, "status.error")
	}
	if v, ok := m["request_id_header"]; ok {
		if s, ok := l.str(v, name, "status.request_id_header"); ok {
			if !isToken(s) {
				l.add(v.Line, name, "status.request_id_header", fmt.Sprintf("%q is not a header name", s), "write e.g. X-Request-Id")
			} else {
				st.RequestIDHeader = s
			}
		}
	}
}

func (l *loader) submit(n *yaml.Node, p *Provider) {
	name := p.Name
	m := l.mapping(n, name, "submit", "request", "job_id", "status_location", "idempotency_header")
	if m == nil {
		return
	}
	s := &SubmitSpec{}
	if v, ok := m["request"]; !ok {
		l.add(n.Line, name, "submit.request", "missing", `write e.g. "POST /v1/jobs"`)
	} else if t, ok := l.template(v, name, "submit.request"); ok {
		if t.FieldURL != "" {
			l.add(v.Line, name, "submit.request", "must be a path template", "write e.g. POST /v1/jobs")
		} else {
			l.knownPlaceholders(v.Line, p, "submit.request", t, p.Status.Request.Placeholders())
			s.Request = t
		}
	}
	if v, ok := m["job_id"]; ok {
		s.JobID, _ = l.gjsonPath(v, name, "submit.job_id")
	}
	if v, ok := m["status_location"]; ok {
		s.StatusLocation, _ = l.bool(v, name, "submit.status_location")
	}
	if v, ok := m["idempotency_header"]; ok {
		if h, ok := l.str(v, name, "submit.idempotency_header"); ok {
			if !isToken(h) {
				l.add(v.Line, name, "submit.idempotency_header", fmt.Sprintf("%q is not a header name", h), "write e.g. Idempotency-Key")
			} else {
				s.IdempotencyHeader = h
			}
		}
	}
	if _, ok := m["job_id"]; !ok && !s.StatusLocation {
		l.add(n.Line, name, "submit", "names neither job_id nor status_location", "set job_id to the body field with the job id, or status_location: true (R14: never guess)")
	}
	p.Submit = s
}

func (l *loader) action(n *yaml.Node, p *Provider, kind string) *ActionSpec {
	m := l.mapping(n, p.Name, kind, "request")
	if m == nil {
		return nil
	}
	v, ok := m["request"]
	if !ok {
		l.add(n.Line, p.Name, kind+".request", "missing", `write e.g. "POST /v1/jobs/{job_id}/cancel"`)
		return nil
	}
	t, ok := l.template(v, p.Name, kind+".request")
	if !ok {
		return nil
	}
	known := append([]string{"job_id"}, p.Status.Request.Placeholders()...)
	if kind == "result" {
		known = append(known, p.Status.SuccessRequires...)
		if t.FieldURL != "" && !contains(p.Status.SuccessRequires, t.FieldURL) {
			l.add(v.Line, p.Name, "result.request", fmt.Sprintf("field {%s} is not in status.success_requires", t.FieldURL), "list it in success_requires so success waits for a valid URL (R3)")
			return &ActionSpec{Request: t}
		}
	} else if t.FieldURL != "" {
		l.add(v.Line, p.Name, kind+".request", "must be a path template", "write e.g. POST /v1/jobs/{job_id}/cancel")
		return nil
	}
	l.knownPlaceholders(v.Line, p, kind+".request", t, known)
	return &ActionSpec{Request: t}
}

func (l *loader) knownPlaceholders(line int, p *Provider, field string, t Template, known []string) {
	for _, ph := range t.Placeholders() {
		if !contains(known, ph) {
			hint := "use a placeholder of status.request"
			if len(known) > 0 {
				hint = "known placeholders: " + strings.Join(dedupe(known), ", ")
			}
			l.add(line, p.Name, field, fmt.Sprintf("unknown placeholder {%s}", ph), hint)
		}
	}
}

// checkOverlaps reports request templates of different providers (or of
// different calls of one provider) that could match the same request.
func (l *loader) checkOverlaps(ps []*Provider) {
	type entry struct {
		p    *Provider
		kind Kind
		t    Template
		segs []segment
	}
	var all []entry
	for _, p := range ps {
		if p.BaseURL == nil {
			continue
		}
		for _, kt := range p.templates() {
			segs, err := fullSegments(p.BaseURL, kt.t)
			if err != nil {
				continue
			}
			all = append(all, entry{p, kt.kind, kt.t, segs})
		}
	}
	reported := map[[2]string]bool{}
	for i := range all {
		for j := i + 1; j < len(all); j++ {
			a, b := all[i], all[j]
			if a.t.Method != b.t.Method || hostKey(a.p.BaseURL) != hostKey(b.p.BaseURL) || !segmentsOverlap(a.segs, b.segs) {
				continue
			}
			key := [2]string{a.p.Name + "/" + string(a.kind), b.p.Name + "/" + string(b.kind)}
			if reported[key] {
				continue
			}
			reported[key] = true
			if a.p == b.p {
				l.add(b.p.Line, b.p.Name, string(b.kind)+".request", fmt.Sprintf("%q overlaps %s.request %q", b.t.String(), a.kind, a.t.String()), "each call of a provider needs a distinct method or path")
			} else {
				l.add(b.p.Line, b.p.Name, string(b.kind)+".request", fmt.Sprintf("%q on %s overlaps provider %q (line %d) %s.request %q", b.t.String(), b.p.BaseURL.String(), a.p.Name, a.p.Line, a.kind, a.t.String()),
					"two providers may not claim the same request; use distinct base_url path prefixes or templates")
			}
		}
	}
}

type kindTemplate struct {
	kind Kind
	t    Template
}

// templates returns the path templates Match considers, in match order.
func (p *Provider) templates() []kindTemplate {
	var out []kindTemplate
	if !p.Status.Request.IsZero() {
		out = append(out, kindTemplate{KindStatus, p.Status.Request})
	}
	if p.Submit != nil && !p.Submit.Request.IsZero() {
		out = append(out, kindTemplate{KindSubmit, p.Submit.Request})
	}
	if p.Cancel != nil && !p.Cancel.Request.IsZero() && p.Cancel.Request.FieldURL == "" {
		out = append(out, kindTemplate{KindCancel, p.Cancel.Request})
	}
	if p.Result != nil && !p.Result.Request.IsZero() && p.Result.Request.FieldURL == "" {
		out = append(out, kindTemplate{KindResult, p.Result.Request})
	}
	return out
}

func fullSegments(base *url.URL, t Template) ([]segment, error) {
	return splitSegments(strings.TrimSuffix(base.Path, "/") + t.Path)
}

// validGJSONPath checks the subset of gjson path syntax pollgate accepts:
// non-empty dotted components, escapes with \, balanced brackets and
// parentheses in queries, # and @modifiers. gjson itself never rejects a
// path, so this catches typos before they silently select nothing.
func validGJSONPath(p string) error {
	if p == "" {
		return fmt.Errorf("empty path")
	}
	if strings.TrimSpace(p) != p {
		return fmt.Errorf("leading or trailing space")
	}
	depth := 0
	comp := 0 // length of the current component
	inQuote := false
	for i := 0; i < len(p); i++ {
		c := p[i]
		if c < 0x20 {
			return fmt.Errorf("control character at %d", i)
		}
		if inQuote {
			if c == '\\' {
				i++
			} else if c == '"' {
				inQuote = false
			}
			comp++
			continue
		}
		switch c {
		case '\\':
			if i+1 >= len(p) {
				return fmt.Errorf("dangling escape at the end")
			}
			i++
			comp++
		case '"':
			if depth == 0 {
				return fmt.Errorf("quote outside a query at %d", i)
			}
			inQuote = true
		case '[', '(':
			depth++
			comp++
		case ']', ')':
			depth--
			if depth < 0 {
				return fmt.Errorf("unbalanced %q at %d", c, i)
			}
			comp++
		case '.', '|':
			if depth == 0 {
				if comp == 0 {
					return fmt.Errorf("empty component at %d", i)
				}
				comp = 0
				continue
			}
			comp++
		default:
			comp++
		}
	}
	if inQuote {
		return fmt.Errorf("unterminated quote")
	}
	if depth != 0 {
		return fmt.Errorf("unbalanced brackets")
	}
	if comp == 0 {
		return fmt.Errorf("empty last component")
	}
	return nil
}

func join(a, b string) string {
	if a == "" {
		return b
	}
	return a + "." + b
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func dedupe(list []string) []string {
	var out []string
	for _, s := range list {
		if !contains(out, s) {
			out = append(out, s)
		}
	}
	return out
}

// closest returns the allowed key within edit distance 2 of key, if any.
func closest(key string, allowed []string) string {
	best, bestD := "", 3
	for _, a := range allowed {
		if d := editDistance(key, a); d < bestD {
			best, bestD = a, d
		}
	}
	return best
}

func editDistance(a, b string) int {
	if len(a) > 64 || len(b) > 64 {
		return 99
	}
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
