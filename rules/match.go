package rules

import (
	"net"
	"net/url"
	pathpkg "path"
	"sort"
	"strings"
)

// hostKey is "host:port" in lower case with the scheme's default port
// filled in, so https://api.x.com and https://api.x.com:443 are one host.
func hostKey(u *url.URL) string {
	host := strings.ToLower(u.Hostname())
	port := u.Port()
	if port == "" {
		switch strings.ToLower(u.Scheme) {
		case "http":
			port = "80"
		default:
			port = "443"
		}
	}
	return net.JoinHostPort(host, port)
}

// Match finds the provider call a request is. u must be absolute (scheme,
// host, path; the query is ignored). The method must equal the template's;
// host and port (default by scheme) must equal the provider's base_url; the
// path must start with the base_url path prefix and the rest must match the
// template segment by segment, each {placeholder} standing for one path
// segment (or the part of one between a literal prefix and suffix, as in
// "{job_id}:cancel"). The path is cleaned first (duplicate and trailing
// slashes, dot segments). Calls are tried in the order status, submit,
// cancel, result.
//
// Templates that take their URL from a field ("GET {result_url}") are not
// matched here: their URL is only known from a stored success response, so
// the proxy compares such requests with Operation.ResultURL itself.
func (c *Contract) Match(method string, u *url.URL) (Match, bool) {
	if c == nil || u == nil || u.Host == "" {
		return Match{}, false
	}
	hk := hostKey(u)
	// Clean the path so a spelling variant ("/v1//jobs/x/", "/v1/./jobs/x")
	// of a governed call cannot slip past as ungoverned traffic. Escaped
	// slashes (%2F) stay inside their segment.
	path := pathpkg.Clean("/" + u.EscapedPath())
	for _, p := range c.Providers {
		if p.BaseURL == nil || hostKey(p.BaseURL) != hk {
			continue
		}
		prefix := strings.TrimSuffix(p.BaseURL.EscapedPath(), "/")
		if !strings.HasPrefix(path, prefix+"/") && path != prefix {
			continue
		}
		rest := strings.TrimPrefix(strings.TrimPrefix(path, prefix), "/")
		var parts []string
		if rest != "" {
			parts = strings.Split(rest, "/")
		}
		for _, kt := range p.matchers() {
			if kt.t.Method != method {
				continue
			}
			params, ok := matchSegments(kt.segs, parts)
			if !ok {
				continue
			}
			// The job id is the value of the status template's job id
			// placeholder; submit and result calls usually have none.
			m := Match{Provider: p, Kind: kt.kind, Params: params}
			if name := p.Status.Request.JobIDParam(); name != "" {
				m.JobID = params[name]
			}
			return m, true
		}
	}
	return Match{}, false
}

// ProviderByName returns the provider with that name, or nil.
func (c *Contract) ProviderByName(name string) *Provider {
	if c == nil {
		return nil
	}
	for _, p := range c.Providers {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// Hosts returns the sorted, lower-cased host names (without port) of every
// provider base_url: the hosts whose TLS the proxy must intercept.
func (c *Contract) Hosts() []string {
	if c == nil {
		return nil
	}
	seen := map[string]bool{}
	var out []string
	for _, p := range c.Providers {
		if p.BaseURL == nil {
			continue
		}
		h := strings.ToLower(p.BaseURL.Hostname())
		if !seen[h] {
			seen[h] = true
			out = append(out, h)
		}
	}
	sort.Strings(out)
	return out
}

// StatusParams returns the placeholder values of a status URL of p, or
// false when the URL is not one of p's status URLs.
func (p *Provider) StatusParams(u *url.URL) (map[string]string, bool) {
	c := &Contract{Providers: []*Provider{p}}
	m, ok := c.Match(p.Status.Request.Method, u)
	if !ok || m.Kind != KindStatus {
		return nil, false
	}
	return m.Params, true
}

// matchers returns the provider's path templates with their parsed
// segments: precompiled by Parse, computed on the fly for a Provider built
// by hand.
func (p *Provider) matchers() []compiledTemplate {
	if p.compiled != nil {
		return p.compiled
	}
	return compileTemplates(p)
}

type compiledTemplate struct {
	kindTemplate
	segs []segment
}

func compileTemplates(p *Provider) []compiledTemplate {
	out := []compiledTemplate{}
	for _, kt := range p.templates() {
		segs, err := splitSegments(kt.t.Path)
		if err != nil {
			continue
		}
		out = append(out, compiledTemplate{kt, segs})
	}
	return out
}

// BooleanStates reports whether every state in the table is "true" or
// "false", i.e. the state field is a JSON boolean (Google's done). Writers
// of the state field (escalation bodies) should then write a raw boolean,
// also when the field is absent from the answer.
func (s StatusSpec) BooleanStates() bool {
	n := 0
	for _, list := range [][]string{s.States.Waiting, s.States.Success, s.States.Failure, s.States.Cancelled, s.States.Expired} {
		for _, v := range list {
			if v != "true" && v != "false" {
				return false
			}
			n++
		}
	}
	return n > 0
}
